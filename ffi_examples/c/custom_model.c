/*
 * custom_model.c: a C server's own engine under libserve's batching (ARCHITECTURE.md §6,
 * serve_runtime_add_custom_model). Built and run by tests/custom_native.rs (under
 * AddressSanitizer + UBSan with SERVE_C_SANITIZE=1).
 *
 * The engine: an affine map y[j] = scale · Σ_i x[i] · (i + 1) + j per row, split into two layers
 * (layer 0: s = Σ_i x[i]·(i+1) into one value; layer 1: y[j] = scale · s + j), so whole-model
 * and layer calls are both exercised. It fails a batch on purpose when a row's first input is
 * negative (returning 7 with a message) or equal to -99 (returning a garbage code with no
 * message). Checks: every request completes exactly once with the engine's output or BACKEND
 * with the engine's message; batching happened; bad registrations are refused precisely; the user
 * data is freed exactly once, after the options and the model are freed.
 *
 * Usage: custom_model
 */
#include "libserve.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define IN 6
#define OUT 4
#define REQUESTS 200

/* The engine's state: what a real server would keep (weights, a device handle, ...). */
typedef struct engine {
  float scale;
  atomic_int calls;
  atomic_int rows;
  atomic_int layer_calls;
  atomic_int freed;
} engine;

static float row_sum(const float *x) {
  float s = 0.0f;
  for (int i = 0; i < IN; i++) s += x[i] * (float)(i + 1);
  return s;
}

static int32_t execute(void *user_data, const serve_custom_call *call) {
  engine *e = user_data;
  atomic_fetch_add(&e->calls, 1);
  atomic_fetch_add(&e->rows, (int)call->batch);
  if (call->first_layer != 0 || call->last_layer != 2) atomic_fetch_add(&e->layer_calls, 1);
  for (size_t r = 0; r < call->batch; r++) {
    const float *x = call->input + r * call->input_stride;
    if (call->first_layer == 0 && x[0] == -99.0f) return -12345; /* garbage code, no message */
    if (call->first_layer == 0 && x[0] < 0.0f) {
      snprintf(call->message, call->message_capacity, "negative input in row %zu", r);
      return 7;
    }
  }
  for (size_t r = 0; r < call->batch; r++) {
    const float *x = call->input + r * call->input_stride;
    float *y = call->output + r * call->output_stride;
    float s = call->first_layer == 0 ? row_sum(x) : x[0];
    if (call->last_layer == 1) {
      y[0] = s; /* layer 0 only */
    } else {
      for (int j = 0; j < OUT; j++) y[j] = e->scale * s + (float)j;
    }
  }
  return 0;
}

static void free_engine(void *user_data) {
  engine *e = user_data;
  atomic_fetch_add(&e->freed, 1);
}

int main(void) {
  serve_runtime_options *ro = NULL;
  serve_runtime *rt = NULL;
  if (!ok(serve_runtime_options_new(&ro), "runtime options") ||
      !ok(serve_runtime_options_set_backend(ro, "cpu"), "backend") ||
      !ok(serve_runtime_new(ro, &rt), "runtime")) {
    return 1;
  }
  serve_runtime_options_free(ro);

  engine eng = {.scale = 0.5f};
  serve_custom_model_options *co = NULL;

  /* Bad registrations: each refused precisely, nothing kept, the user data not freed. */
  serve_custom_model_options *never = (serve_custom_model_options *)0x1;
  expect_error(serve_custom_model_options_new(0, OUT, execute, &eng, free_engine, &never),
               SERVE_CODE_INVALID_ARGUMENT, "input length is 0", "zero input length");
  expect_error(serve_custom_model_options_new(IN, 0, execute, &eng, free_engine, &never),
               SERVE_CODE_INVALID_ARGUMENT, "output length is 0", "zero output length");
  expect_error(serve_custom_model_options_new(IN, OUT, NULL, &eng, free_engine, &never),
               SERVE_CODE_INVALID_ARGUMENT, "`execute` is NULL", "NULL execute");
  expect_error(serve_custom_model_options_new(IN, OUT, execute, &eng, free_engine, NULL),
               SERVE_CODE_INVALID_ARGUMENT, "`out` is NULL", "NULL out");
  CHECK(never == (serve_custom_model_options *)0x1, "out-parameter untouched on error");
  CHECK(atomic_load(&eng.freed) == 0, "user data freed by a failed registration");

  if (!ok(serve_custom_model_options_new(IN, OUT, execute, &eng, free_engine, &co), "options")) {
    return 1;
  }
  /* Layers whose last output is not the model's: refused when the model is added. */
  if (!ok(serve_custom_model_options_add_layer(co, "sum", 4 * IN, 2 * IN, 1), "layer 0")) return 1;
  serve_model *bad = NULL;
  expect_error(serve_runtime_add_custom_model(rt, "half", co, NULL, &bad), SERVE_CODE_INVALID_ARGUMENT,
               "last layer of a custom model gives 1 values", "inconsistent layers");
  if (!ok(serve_custom_model_options_add_layer(co, "affine", 4, 2 * OUT, OUT), "layer 1")) return 1;
  expect_error(serve_custom_model_options_add_layer(co, NULL, 0, 0, 1), SERVE_CODE_INVALID_ARGUMENT,
               "`name` is NULL", "NULL layer name");
  CHECK(atomic_load(&eng.freed) == 0, "user data freed while the options live");

  /* Batches of up to 16, waiting up to 2 ms for company. */
  serve_model_options *mo = NULL;
  serve_model *model = NULL;
  if (!ok(serve_model_options_new(&mo), "model options") ||
      !ok(serve_model_options_set_max_batch(mo, 16), "max batch") ||
      !ok(serve_model_options_set_max_wait_ns(mo, 2000000), "max wait") ||
      !ok(serve_runtime_add_custom_model(rt, "affine", co, mo, &model), "add custom model")) {
    return 1;
  }
  serve_model_options_free(mo);
  serve_custom_model_options_free(co); /* the model keeps its description */
  CHECK(atomic_load(&eng.freed) == 0, "user data freed while the model lives");
  CHECK(strcmp(serve_model_kind(model), "custom") == 0, "kind `%s`", serve_model_kind(model));
  CHECK(serve_model_input_len(model) == IN && serve_model_output_len(model) == OUT, "sizes %zu, %zu",
        serve_model_input_len(model), serve_model_output_len(model));

  /* Wrong lengths are refused at submit, as for any model. */
  serve_queue *q = NULL;
  if (!ok(serve_queue_new(&q), "queue")) return 1;
  float x[IN + 1] = {0};
  expect_error(serve_submit_f32(model, q, 0, x, IN + 1, NULL, NULL), SERVE_CODE_INVALID_ARGUMENT,
               "length 7", "wrong input length");

  /* Requests 0..REQUESTS: every 25th one makes its batch fail (code 7 with a message, or every
   * 50th a garbage code); the others compute. */
  bool poisoned[REQUESTS] = {false};
  for (int k = 0; k < REQUESTS; k++) {
    for (int i = 0; i < IN; i++) x[i] = (float)((k * 7 + i * 3) % 11) * 0.25f;
    if (k % 25 == 24) {
      x[0] = k % 50 == 49 ? -99.0f : -1.0f;
      poisoned[k] = true;
    }
    if (!ok(serve_submit_f32(model, q, (uint64_t)k, x, IN, NULL, NULL), "submit")) return 1;
  }
  int done = 0, failed = 0, seen[REQUESTS] = {0};
  while (done < REQUESTS) {
    serve_completion *cs[32];
    size_t n = 0;
    if (!ok(serve_queue_next(q, cs, 32, 10ull * 1000000000ull, &n), "queue next")) return 1;
    if (n == 0) {
      fail("no completion within 10 s (%d of %d done)", done, REQUESTS);
      return 1;
    }
    for (size_t c = 0; c < n; c++) {
      uint64_t k = serve_completion_tag(cs[c]);
      seen[k]++;
      if (serve_completion_code(cs[c]) == SERVE_CODE_OK) {
        const float *y = NULL;
        size_t len = 0;
        if (ok(serve_completion_output_f32(cs[c], &y, &len), "output")) {
          float xr[IN];
          for (int i = 0; i < IN; i++) xr[i] = (float)(((int)k * 7 + i * 3) % 11) * 0.25f;
          CHECK(len == OUT, "request %llu: %zu outputs", (unsigned long long)k, len);
          for (int j = 0; j < OUT && j < (int)len; j++) {
            float want = eng.scale * row_sum(xr) + (float)j;
            CHECK(y[j] == want, "request %llu output %d: %g, want %g", (unsigned long long)k, j, y[j], want);
          }
          CHECK(!poisoned[k], "poisoned request %llu succeeded", (unsigned long long)k);
        }
      } else {
        failed++;
        const char *m = serve_completion_message(cs[c]);
        CHECK(serve_completion_code(cs[c]) == SERVE_CODE_BACKEND, "request %llu: code %s",
              (unsigned long long)k, serve_code_name((uint32_t)serve_completion_code(cs[c])));
        CHECK(m != NULL && (strstr(m, "execute returned 7: negative input in row") != NULL ||
                            strstr(m, "execute returned -12345") != NULL),
              "request %llu: message `%s`", (unsigned long long)k, m ? m : "(null)");
      }
      serve_completion_free(cs[c]);
      done++;
    }
  }
  for (int k = 0; k < REQUESTS; k++) CHECK(seen[k] == 1, "request %d completed %d times", k, seen[k]);
  /* A poisoned row fails its whole batch: at least the poisoned requests failed. */
  CHECK(failed >= REQUESTS / 25, "%d failures", failed);
  CHECK(atomic_load(&eng.rows) >= REQUESTS, "%d rows computed", atomic_load(&eng.rows));
  CHECK(atomic_load(&eng.calls) < REQUESTS, "no batching: %d calls for %d requests",
        atomic_load(&eng.calls), REQUESTS);
  CHECK(atomic_load(&eng.layer_calls) == 0, "%d layer-range calls: the timeout policy runs whole tasks",
        atomic_load(&eng.layer_calls));

  /* The model keeps serving after the failures. */
  for (int i = 0; i < IN; i++) x[i] = 1.0f;
  if (!ok(serve_submit_f32(model, q, 1000, x, IN, NULL, NULL), "submit after failures")) return 1;
  serve_completion *c = NULL;
  size_t n = 0;
  if (ok(serve_queue_next(q, &c, 1, 10ull * 1000000000ull, &n), "last") && n == 1) {
    CHECK(serve_completion_code(c) == SERVE_CODE_OK, "the model stopped serving after failures");
    serve_completion_free(c);
  } else {
    fail("no completion for the last request");
  }

  serve_model_free(model);
  serve_queue_free(q);
  serve_runtime_free(rt); /* joins every libserve thread: the model is dropped by now */
  CHECK(atomic_load(&eng.freed) == 1, "user data freed %d times", atomic_load(&eng.freed));
  printf("custom model: %d calls, %d rows, %d failed requests\n", atomic_load(&eng.calls),
         atomic_load(&eng.rows), failed);
  if (atomic_load(&g_failures) != 0) {
    printf("custom_model: %d check(s) FAILED\n", atomic_load(&g_failures));
    return 1;
  }
  printf("custom_model: all checks passed\n");
  return 0;
}
