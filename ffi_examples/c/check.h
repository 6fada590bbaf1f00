/* Failure reporting shared by the C programs of ffi_examples/c (example.c, soak.c,
 * custom_model.c, tenants.c): a check that fails prints `FAIL: ...` on its own line and is
 * counted in g_failures; the program's exit status comes from the count. Include after
 * libserve.h, <stdarg.h>, <stdatomic.h>, <stdbool.h>, <stdint.h>, <stdio.h> and <string.h>.
 * Header-private (static) to each program. */
#ifndef SERVE_EXAMPLES_CHECK_H
#define SERVE_EXAMPLES_CHECK_H

static atomic_int g_failures;

/* Print `FAIL: <message>` as one line (whole even with several threads failing) and count it. */
__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  flockfile(stdout);
  fputs("FAIL: ", stdout);
  vfprintf(stdout, fmt, ap);
  fputc('\n', stdout);
  fflush(stdout);
  funlockfile(stdout);
  va_end(ap);
  atomic_fetch_add(&g_failures, 1);
}

#define CHECK(cond, ...)                                                                          \
  do {                                                                                            \
    if (!(cond)) fail(__VA_ARGS__);                                                               \
  } while (0)

/* Expect success: on error report `what: CODE: message`, free it, return false. */
static bool ok(serve_error *err, const char *what) {
  if (err == NULL) return true;
  fail("%s: %s: %s", what, serve_code_name((uint32_t)serve_error_code(err)),
       serve_error_message(err));
  serve_error_free(err);
  return false;
}

/* Expect `err` to be code `code` with `needle` in its message; free it. (Inline: not every
 * program uses it.) */
static inline void expect_error(serve_error *err, serve_code code, const char *needle,
                                const char *what) {
  if (err == NULL) {
    fail("%s: succeeded, expected %s", what, serve_code_name((uint32_t)code));
    return;
  }
  CHECK(serve_error_code(err) == code, "%s: code %s, expected %s", what,
        serve_code_name((uint32_t)serve_error_code(err)), serve_code_name((uint32_t)code));
  CHECK(strstr(serve_error_message(err), needle) != NULL, "%s: message `%s` lacks `%s`", what,
        serve_error_message(err), needle);
  serve_error_free(err);
}

#endif
