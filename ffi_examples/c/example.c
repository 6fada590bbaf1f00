/*
 * example.c — a real C consumer of libserve (include/libserve.h), exercising the whole C ABI.
 *
 * Usage: example MODEL_DIR EXPECTED_FILE [LSTM_DIR TREELSTM_DIR RECURRENT_FILE]
 *
 *   MODEL_DIR      an `mlp` model directory (model.toml + weights.safetensors).
 *   EXPECTED_FILE  whitespace-separated text (newlines are not significant):
 *
 *                    INPUT_LEN OUTPUT_LEN K
 *                    then K records, each INPUT_LEN input values followed by the OUTPUT_LEN
 *                    values the model must produce for that input
 *
 *                  Values are decimal floats as accepted by strtof ("0.25", "-1.5e-3", ...).
 *   LSTM_DIR, TREELSTM_DIR   an `lstm` and a `treelstm` model directory.
 *   RECURRENT_FILE whitespace-separated text: `LSTM K` then K records `LEN TOKENS... OUT_LEN
 *                  OUTPUT...`, then `TREE K` then K records `N TOKENS... PARENTS... OUT_LEN
 *                  OUTPUT...` (a tree's nodes in any order, parent -1 for the root).
 *
 * What it checks: version macros against serve_version(); runtime / model options and their
 * validation; model metadata; 4 threads submitting concurrently (retrying on SERVE_CODE_BUSY)
 * while the main thread drains with serve_queue_next batches and with poll() on serve_queue_fd;
 * every output against EXPECTED_FILE (relative tolerance 1e-4, absolute below magnitude 1); every
 * tag completing exactly once; cancellation; deadlines; precise error codes for bad calls with
 * out-parameters left untouched; _free(NULL); a callback-mode queue; stats consistency; shutdown
 * (pending requests complete, later submits fail SERVE_CODE_SHUTDOWN); freeing everything. With
 * the recurrent arguments also: lstm requests (serve_submit_tokens) and treelstm requests
 * (serve_submit_tree) under cellular batching and the padding baseline, outputs checked, policy
 * options validated, malformed trees and out-of-vocabulary tokens refused.
 *
 * Prints `FAIL: ...` for each failed check and exits 1; exits 0 after printing
 * `example: all checks passed` only when every check passed.
 *
 * Build (what tests/c_example.rs does; ffi_examples/c/run_asan.sh adds the sanitizers):
 *   static:  cc -std=c11 -Wall -Wextra -Werror -pthread -I include ffi_examples/c/example.c \
 *              target/debug/libserve.a -ldl -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc -o example
 *            (the libraries `cargo rustc --lib --crate-type staticlib -- --print native-static-libs`
 *            lists on x86_64 Linux)
 *   shared:  cc ... -L target/debug -lserve -o example; run with libserve.so.0 (the SONAME) on
 *            LD_LIBRARY_PATH.
 */

#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "libserve.h"
#include "check.h"

/* ---------------------------------------------------------------------------------------------
 * Check helpers (fail, CHECK, ok: check.h)
 * ------------------------------------------------------------------------------------------- */

/* Expect an error with code `want` and a non-empty message; free it. */
static bool expect_code(serve_error *err, serve_code want, const char *what) {
  if (err == NULL) {
    fail("%s: succeeded, expected %s", what, serve_code_name((uint32_t)want));
    return false;
  }
  serve_code got = serve_error_code(err);
  const char *msg = serve_error_message(err);
  bool good = true;
  if (got != want) {
    fail("%s: got %s (%s), expected %s", what, serve_code_name((uint32_t)got), msg,
         serve_code_name((uint32_t)want));
    good = false;
  } else if (msg == NULL || msg[0] == '\0') {
    fail("%s: error %s has an empty message", what, serve_code_name((uint32_t)got));
    good = false;
  }
  serve_error_free(err);
  return good;
}

static void sleep_ns(long ns) {
  struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

static uint64_t ms_to_ns(uint64_t ms) { return ms * 1000000ull; }

/* Sentinels for out-parameters that must stay untouched on error. */
#define SENTINEL_U64 UINT64_C(0xDEADBEEFCAFEF00D)
#define SENTINEL_SIZE ((size_t)0xDEADBEEF)
#define SENTINEL_PTR(T) ((T *)(uintptr_t)0xDEADBEEF)

/* ---------------------------------------------------------------------------------------------
 * Expected data
 * ------------------------------------------------------------------------------------------- */

typedef struct {
  size_t in_len, out_len, k;
  float *inputs;  /* k × in_len */
  float *outputs; /* k × out_len */
} expected;

static bool read_expected(const char *path, expected *e) {
  memset(e, 0, sizeof *e);
  FILE *f = fopen(path, "r");
  if (f == NULL) {
    fail("cannot open %s", path);
    return false;
  }
  bool good = fscanf(f, "%zu %zu %zu", &e->in_len, &e->out_len, &e->k) == 3 && e->in_len > 0 &&
              e->out_len > 0 && e->k > 0 && e->in_len < 1000000 && e->out_len < 1000000 &&
              e->k < 100000;
  if (good) {
    e->inputs = calloc(e->k * e->in_len, sizeof(float));
    e->outputs = calloc(e->k * e->out_len, sizeof(float));
    good = e->inputs != NULL && e->outputs != NULL;
  }
  for (size_t i = 0; good && i < e->k; i++) {
    for (size_t j = 0; good && j < e->in_len; j++)
      good = fscanf(f, "%f", &e->inputs[i * e->in_len + j]) == 1;
    for (size_t j = 0; good && j < e->out_len; j++)
      good = fscanf(f, "%f", &e->outputs[i * e->out_len + j]) == 1;
  }
  fclose(f);
  if (!good) fail("%s is malformed (see the format at the top of example.c)", path);
  return good;
}

static void free_expected(expected *e) {
  free(e->inputs);
  free(e->outputs);
}

static float absf(float x) { return x < 0 ? -x : x; }

/* Check a completion's code and, when OK, its output against input `idx`. Returns true if OK. */
static bool check_output(const expected *e, const serve_completion *c, size_t idx,
                         const char *what) {
  serve_code code = serve_completion_code(c);
  if (code != SERVE_CODE_OK) {
    const char *m = serve_completion_message(c);
    fail("%s: tag %" PRIu64 " completed %s: %s", what, serve_completion_tag(c),
         serve_code_name((uint32_t)code), m ? m : "(no message)");
    return false;
  }
  if (serve_completion_message(c) != NULL) fail("%s: an OK completion has a message", what);
  const float *data = SENTINEL_PTR(const float);
  size_t len = SENTINEL_SIZE;
  if (!ok(serve_completion_output_f32(c, &data, &len), what)) return false;
  if (len != e->out_len || data == NULL) {
    fail("%s: output has %zu values, expected %zu", what, len, e->out_len);
    return false;
  }
  const float *want = &e->outputs[idx * e->out_len];
  for (size_t j = 0; j < len; j++) {
    float tol = 1e-4f * (absf(want[j]) > 1.0f ? absf(want[j]) : 1.0f);
    if (!(absf(data[j] - want[j]) <= tol)) {
      fail("%s: tag %" PRIu64 " output[%zu] = %.9g, expected %.9g (input %zu)", what,
           serve_completion_tag(c), j, (double)data[j], (double)want[j], idx);
      return false;
    }
  }
  /* An f32 output is not tokens; out-parameters stay untouched. */
  const uint32_t *tok = SENTINEL_PTR(const uint32_t);
  size_t tlen = SENTINEL_SIZE;
  expect_code(serve_completion_output_tokens(c, &tok, &tlen), SERVE_CODE_INVALID_ARGUMENT,
              "serve_completion_output_tokens on an f32 completion");
  CHECK(tok == SENTINEL_PTR(const uint32_t) && tlen == SENTINEL_SIZE,
        "serve_completion_output_tokens wrote its out-parameters on error");
  return true;
}

/* Submit, retrying on BUSY for up to 60 s. Returns the final error (NULL on success). */
static serve_error *submit_retry(const serve_model *m, const serve_queue *q, uint64_t tag,
                                 const float *in, size_t len, const serve_submit_options *o,
                                 uint64_t *id, atomic_ulong *busy_count) {
  uint64_t give_up = serve_now_ns() + ms_to_ns(60000);
  for (;;) {
    serve_error *err = serve_submit_f32(m, q, tag, in, len, o, id);
    if (err == NULL || serve_error_code(err) != SERVE_CODE_BUSY || serve_now_ns() > give_up)
      return err;
    serve_error_free(err);
    if (busy_count) atomic_fetch_add(busy_count, 1);
    sleep_ns(200000); /* 200 µs */
  }
}

/* ---------------------------------------------------------------------------------------------
 * Concurrent submitters + drainer
 * ------------------------------------------------------------------------------------------- */

enum { THREADS = 4, PER_THREAD = 300, BATCH = 64 };

/* tag = thread << 48 | seq << 16 | input index */
static uint64_t make_tag(unsigned t, unsigned seq, size_t idx) {
  return ((uint64_t)t << 48) | ((uint64_t)seq << 16) | (uint64_t)idx;
}

typedef struct {
  const serve_model *model;
  const serve_queue *queue;
  const expected *e;
  const serve_submit_options *opts[THREADS];
  atomic_ulong accepted;     /* requests accepted by submit */
  atomic_ulong busy;         /* BUSY answers retried */
  atomic_int threads_done;   /* submitter threads finished */
  uint64_t ids[THREADS][PER_THREAD];        /* id returned by submit (written by submitters) */
  bool accepted_slot[THREADS][PER_THREAD];  /* written by submitters */
  uint64_t completed_id[THREADS][PER_THREAD]; /* written by the drainer */
  unsigned seen[THREADS][PER_THREAD];       /* written by the drainer */
} load_state;

typedef struct {
  load_state *s;
  unsigned t;
} thread_arg;

static void *submitter(void *p) {
  thread_arg *a = p;
  load_state *s = a->s;
  for (unsigned seq = 0; seq < PER_THREAD; seq++) {
    size_t idx = (a->t + seq) % s->e->k;
    uint64_t id = SENTINEL_U64;
    serve_error *err = submit_retry(s->model, s->queue, make_tag(a->t, seq, idx),
                                    &s->e->inputs[idx * s->e->in_len], s->e->in_len,
                                    s->opts[a->t], &id, &s->busy);
    if (ok(err, "concurrent serve_submit_f32")) {
      CHECK(id != SENTINEL_U64, "serve_submit_f32 succeeded without writing *request_id");
      s->ids[a->t][seq] = id;
      s->accepted_slot[a->t][seq] = true;
      atomic_fetch_add(&s->accepted, 1);
    }
  }
  atomic_fetch_add(&s->threads_done, 1);
  return NULL;
}

static bool fd_readable(int fd, int timeout_ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
  int r;
  do {
    r = poll(&p, 1, timeout_ms);
  } while (r < 0);
  return r == 1 && (p.revents & POLLIN);
}

/* Handle one drained completion of the concurrent phase. */
static void on_load_completion(load_state *s, serve_completion *c) {
  uint64_t tag = serve_completion_tag(c);
  unsigned t = (unsigned)(tag >> 48), seq = (unsigned)((tag >> 16) & 0xffffffffu);
  size_t idx = (size_t)(tag & 0xffff);
  if (t >= THREADS || seq >= PER_THREAD || idx != (t + seq) % s->e->k) {
    fail("drained a completion with an unknown tag %#" PRIx64, tag);
  } else {
    s->seen[t][seq]++;
    s->completed_id[t][seq] = serve_completion_request_id(c);
    check_output(s->e, c, idx, "concurrent request");
  }
  serve_completion_free(c);
}

static void run_concurrent_phase(const serve_model *model, const serve_queue *queue,
                                 const expected *e, uint64_t *good_requests) {
  load_state *s = calloc(1, sizeof *s);
  if (s == NULL) {
    fail("out of memory");
    return;
  }
  s->model = model;
  s->queue = queue;
  s->e = e;
  serve_submit_options *prio = NULL, *timeout = NULL;
  ok(serve_submit_options_new(&prio), "serve_submit_options_new");
  ok(serve_submit_options_new(&timeout), "serve_submit_options_new");
  ok(serve_submit_options_set_priority(prio, 5), "serve_submit_options_set_priority");
  /* A far deadline, relative to each submit: must not fire. */
  ok(serve_submit_options_set_timeout_ns(timeout, ms_to_ns(120000)),
     "serve_submit_options_set_timeout_ns");
  s->opts[0] = NULL;
  s->opts[1] = prio;
  s->opts[2] = timeout;
  s->opts[3] = prio; /* shared const by two threads */

  int fd = -1;
  ok(serve_queue_fd(queue, &fd), "serve_queue_fd");
  CHECK(fd >= 0, "serve_queue_fd gave %d", fd);
  if (fd >= 0) CHECK(!fd_readable(fd, 0), "the queue fd is readable on an empty queue");

  pthread_t th[THREADS];
  thread_arg args[THREADS];
  bool started[THREADS] = {false};
  for (unsigned t = 0; t < THREADS; t++) {
    args[t] = (thread_arg){s, t};
    started[t] = pthread_create(&th[t], NULL, submitter, &args[t]) == 0;
    if (!started[t]) {
      fail("pthread_create failed");
      atomic_fetch_add(&s->threads_done, 1);
    }
  }

  serve_completion *batch[BATCH];
  unsigned long received = 0, via_next = 0, via_fd = 0, fd_wakeups = 0, rounds = 0;
  uint64_t give_up = serve_now_ns() + ms_to_ns(120000);
  for (;;) {
    bool done = atomic_load(&s->threads_done) == THREADS;
    if (done && received >= atomic_load(&s->accepted)) break;
    if (serve_now_ns() > give_up) {
      fail("concurrent phase: only %lu of %lu completions arrived within 120 s", received,
           atomic_load(&s->accepted));
      break;
    }
    size_t n = SENTINEL_SIZE;
    /* Alternate drain styles every 4 rounds: blocking batch drain, then fd readiness + poll. */
    if ((rounds++ / 4) % 2 == 0 || fd < 0) {
      if (!ok(serve_queue_next(queue, batch, BATCH, ms_to_ns(50), &n), "serve_queue_next")) break;
      via_next += n;
    } else {
      if (!fd_readable(fd, 50)) continue;
      fd_wakeups++;
      if (!ok(serve_queue_next(queue, batch, BATCH, 0, &n), "serve_queue_next(timeout 0)")) break;
      /* One drainer only: a readable fd means at least one completion is pending. */
      CHECK(n > 0, "the queue fd was readable but serve_queue_next(timeout 0) returned nothing");
      via_fd += n;
    }
    CHECK(n <= BATCH, "serve_queue_next returned %zu > max %d", n, BATCH);
    if (n > BATCH) break;
    for (size_t i = 0; i < n; i++) on_load_completion(s, batch[i]);
    received += n;
  }
  for (unsigned t = 0; t < THREADS; t++)
    if (started[t]) pthread_join(th[t], NULL);

  /* Nothing more may arrive: every accepted tag completed exactly once. */
  size_t n = SENTINEL_SIZE;
  if (ok(serve_queue_next(queue, batch, BATCH, ms_to_ns(100), &n), "serve_queue_next")) {
    CHECK(n == 0, "%zu extra completions after every request completed", n);
    for (size_t i = 0; i < n; i++) on_load_completion(s, batch[i]);
  }
  if (fd >= 0) CHECK(!fd_readable(fd, 0), "the queue fd is readable on a drained queue");
  unsigned long missing = 0, dup = 0, bad_id = 0;
  for (unsigned t = 0; t < THREADS; t++) {
    for (unsigned seq = 0; seq < PER_THREAD; seq++) {
      unsigned want = s->accepted_slot[t][seq] ? 1 : 0;
      if (s->seen[t][seq] < want) missing++;
      if (s->seen[t][seq] > want) dup++;
      if (want && s->seen[t][seq] && s->completed_id[t][seq] != s->ids[t][seq]) bad_id++;
    }
  }
  CHECK(missing == 0, "%lu accepted requests never completed", missing);
  CHECK(dup == 0, "%lu tags completed more than once (or without being accepted)", dup);
  CHECK(bad_id == 0, "%lu completions carry a request id different from submit's", bad_id);
  CHECK(atomic_load(&s->accepted) == THREADS * PER_THREAD, "only %lu of %d submits accepted",
        atomic_load(&s->accepted), THREADS * PER_THREAD);
  CHECK(via_next > 0, "no completion was drained by blocking serve_queue_next");
  CHECK(via_fd > 0, "no completion was drained after poll() on serve_queue_fd");
  printf("concurrent: %lu completions (%lu by serve_queue_next, %lu after %lu fd wakeups), "
         "%lu BUSY retries\n",
         received, via_next, via_fd, fd_wakeups, atomic_load(&s->busy));
  *good_requests += atomic_load(&s->accepted);
  serve_submit_options_free(prio);
  serve_submit_options_free(timeout);
  free(s);
}

/* ---------------------------------------------------------------------------------------------
 * Callback queue
 * ------------------------------------------------------------------------------------------- */

typedef struct {
  const expected *e;
  atomic_ulong delivered;
  atomic_ulong not_ok;
} callback_state;

static void on_completion(void *user_data, serve_completion *c) {
  callback_state *cs = user_data;
  size_t idx = (size_t)serve_completion_tag(c);
  if (idx >= cs->e->k || !check_output(cs->e, c, idx, "callback completion"))
    atomic_fetch_add(&cs->not_ok, 1);
  serve_completion_free(c);
  atomic_fetch_add(&cs->delivered, 1);
}

static void run_callback_phase(const serve_model *model, const expected *e,
                               uint64_t *good_requests) {
  enum { N = 200 };
  callback_state cs = {.e = e};
  atomic_init(&cs.delivered, 0);
  atomic_init(&cs.not_ok, 0);

  serve_queue *bad = SENTINEL_PTR(serve_queue);
  expect_code(serve_queue_new_callback(NULL, &cs, &bad), SERVE_CODE_INVALID_ARGUMENT,
              "serve_queue_new_callback(NULL callback)");
  CHECK(bad == SENTINEL_PTR(serve_queue), "serve_queue_new_callback wrote *out on error");
  expect_code(serve_queue_new_callback(on_completion, &cs, NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_queue_new_callback(NULL out)");

  serve_queue *cq = NULL;
  if (!ok(serve_queue_new_callback(on_completion, &cs, &cq), "serve_queue_new_callback")) return;
  int fd = -12345;
  expect_code(serve_queue_fd(cq, &fd), SERVE_CODE_INVALID_ARGUMENT,
              "serve_queue_fd on a callback queue");
  CHECK(fd == -12345, "serve_queue_fd wrote *fd on error");
  serve_completion *one[1] = {NULL};
  size_t n = SENTINEL_SIZE;
  expect_code(serve_queue_next(cq, one, 1, 0, &n), SERVE_CODE_INVALID_ARGUMENT,
              "serve_queue_next on a callback queue");
  CHECK(n == SENTINEL_SIZE && one[0] == NULL, "serve_queue_next wrote out-parameters on error");

  atomic_ulong busy;
  atomic_init(&busy, 0);
  unsigned long accepted = 0;
  for (unsigned i = 0; i < N; i++) {
    size_t idx = i % e->k;
    if (ok(submit_retry(model, cq, idx, &e->inputs[idx * e->in_len], e->in_len, NULL, NULL, &busy),
           "serve_submit_f32 to a callback queue"))
      accepted++;
  }
  uint64_t give_up = serve_now_ns() + ms_to_ns(60000);
  while (atomic_load(&cs.delivered) < accepted && serve_now_ns() < give_up) sleep_ns(1000000);
  unsigned long got = atomic_load(&cs.delivered);
  CHECK(got == accepted, "callback queue: %lu of %lu completions delivered within 60 s", got,
        accepted);
  CHECK(accepted == N, "callback queue: %lu of %d submits accepted", accepted, N);
  CHECK(atomic_load(&cs.not_ok) == 0, "callback queue: %lu bad completions",
        atomic_load(&cs.not_ok));
  serve_queue_free(cq);
  /* After serve_queue_free returns the callback is never called again. */
  sleep_ns(20000000);
  CHECK(atomic_load(&cs.delivered) == got, "the callback ran after serve_queue_free returned");
  printf("callback: %lu completions delivered\n", got);
  *good_requests += accepted;
}

/* ---------------------------------------------------------------------------------------------
 * Bad calls: precise codes, untouched out-parameters, no completion
 * ------------------------------------------------------------------------------------------- */

static void run_bad_requests(const serve_runtime *rt, const serve_model *model,
                             const serve_queue *queue, const expected *e,
                             uint64_t *expected_rejects) {
  const float *in = e->inputs;
  float big[4096];
  memset(big, 0, sizeof big);
  uint64_t id = SENTINEL_U64;
#define BAD_SUBMIT(call, code, what)                                                              \
  do {                                                                                            \
    id = SENTINEL_U64;                                                                            \
    expect_code(call, code, what);                                                                \
    CHECK(id == SENTINEL_U64, "%s: *request_id written on error", what);                          \
  } while (0)

  BAD_SUBMIT(serve_submit_f32(model, queue, 1, in, e->in_len - 1, NULL, &id),
             SERVE_CODE_INVALID_ARGUMENT, "submit with input one value short");
  if (e->in_len + 1 <= sizeof big / sizeof big[0])
    BAD_SUBMIT(serve_submit_f32(model, queue, 2, big, e->in_len + 1, NULL, &id),
               SERVE_CODE_INVALID_ARGUMENT, "submit with input one value long");
  BAD_SUBMIT(serve_submit_f32(model, queue, 3, in, 0, NULL, &id), SERVE_CODE_INVALID_ARGUMENT,
             "submit with zero-length input");
  BAD_SUBMIT(serve_submit_f32(model, queue, 4, NULL, 0, NULL, &id), SERVE_CODE_INVALID_ARGUMENT,
             "submit with NULL, zero-length input");
  *expected_rejects += 4;
  BAD_SUBMIT(serve_submit_f32(model, queue, 5, NULL, e->in_len, NULL, &id),
             SERVE_CODE_INVALID_ARGUMENT, "submit with NULL input");
  BAD_SUBMIT(serve_submit_f32(NULL, queue, 6, in, e->in_len, NULL, &id),
             SERVE_CODE_INVALID_ARGUMENT, "submit with NULL model");
  BAD_SUBMIT(serve_submit_f32(model, NULL, 7, in, e->in_len, NULL, &id),
             SERVE_CODE_INVALID_ARGUMENT, "submit with NULL queue");
  uint32_t tokens[3] = {1, 2, 3};
  BAD_SUBMIT(serve_submit_tokens(model, queue, 8, tokens, 3, NULL, &id),
             SERVE_CODE_INVALID_ARGUMENT, "serve_submit_tokens to an mlp");
  *expected_rejects += 1;

  serve_submit_options *past = NULL;
  if (ok(serve_submit_options_new(&past), "serve_submit_options_new")) {
    ok(serve_submit_options_set_deadline_ns(past, serve_now_ns() - 1),
       "serve_submit_options_set_deadline_ns");
    BAD_SUBMIT(serve_submit_f32(model, queue, 9, in, e->in_len, past, &id),
               SERVE_CODE_DEADLINE_EXCEEDED, "submit with a deadline already passed");
    *expected_rejects += 1;
    serve_submit_options_free(past);
  }
  expect_code(serve_submit_options_set_priority(NULL, 1), SERVE_CODE_INVALID_ARGUMENT,
              "serve_submit_options_set_priority(NULL)");
  expect_code(serve_submit_options_new(NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_submit_options_new(NULL)");
#undef BAD_SUBMIT

  /* Cancel: a never-issued id, a NULL runtime. */
  expect_code(serve_runtime_cancel(rt, UINT64_MAX), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_cancel(UINT64_MAX)");
  expect_code(serve_runtime_cancel(NULL, 0), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_cancel(NULL runtime)");

  /* Queue calls with bad arguments leave out-parameters untouched. */
  size_t n = SENTINEL_SIZE;
  serve_completion *c[2] = {NULL, NULL};
  expect_code(serve_queue_next(NULL, c, 2, 0, &n), SERVE_CODE_INVALID_ARGUMENT,
              "serve_queue_next(NULL queue)");
  CHECK(n == SENTINEL_SIZE, "serve_queue_next wrote *count on error");
  expect_code(serve_queue_next(queue, NULL, 2, 0, &n), SERVE_CODE_INVALID_ARGUMENT,
              "serve_queue_next(NULL completions)");
  CHECK(n == SENTINEL_SIZE, "serve_queue_next wrote *count on error");
  expect_code(serve_queue_next(queue, c, 2, 0, NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_queue_next(NULL count)");
  int fd = -12345;
  expect_code(serve_queue_fd(NULL, &fd), SERVE_CODE_INVALID_ARGUMENT, "serve_queue_fd(NULL)");
  CHECK(fd == -12345, "serve_queue_fd wrote *fd on error");
  expect_code(serve_queue_new(NULL), SERVE_CODE_INVALID_ARGUMENT, "serve_queue_new(NULL)");

  /* No bad submit produced a completion. */
  if (ok(serve_queue_next(queue, c, 2, ms_to_ns(50), &n), "serve_queue_next")) {
    CHECK(n == 0, "%zu completions produced by failed submits", n);
    for (size_t i = 0; i < n && i < 2; i++) serve_completion_free(c[i]);
  }

  /* Stats and completion getters on NULL. */
  serve_stats *st = SENTINEL_PTR(serve_stats);
  expect_code(serve_runtime_stats(NULL, &st), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_stats(NULL)");
  CHECK(st == SENTINEL_PTR(serve_stats), "serve_runtime_stats wrote *out on error");
  expect_code(serve_runtime_stats(rt, NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_stats(NULL out)");
  CHECK(serve_stats_submitted(NULL) == 0 && serve_stats_completed_total(NULL) == 0 &&
            serve_stats_completed(NULL, SERVE_CODE_OK) == 0 && serve_stats_in_flight(NULL) == 0,
        "serve_stats_* getters on NULL are not 0");
  CHECK(serve_completion_tag(NULL) == 0 && serve_completion_request_id(NULL) == 0 &&
            serve_completion_code(NULL) == SERVE_CODE_INVALID_ARGUMENT &&
            serve_completion_message(NULL) == NULL,
        "serve_completion_* getters on NULL do not give their documented values");
  const float *data = SENTINEL_PTR(const float);
  size_t len = SENTINEL_SIZE;
  expect_code(serve_completion_output_f32(NULL, &data, &len), SERVE_CODE_INVALID_ARGUMENT,
              "serve_completion_output_f32(NULL)");
  CHECK(data == SENTINEL_PTR(const float) && len == SENTINEL_SIZE,
        "serve_completion_output_f32 wrote out-parameters on error");
  CHECK(strcmp(serve_model_kind(NULL), "") == 0 && serve_model_input_len(NULL) == 0 &&
            serve_model_output_len(NULL) == 0,
        "serve_model_* getters on NULL do not give \"\" / 0");
  CHECK(strcmp(serve_runtime_backend(NULL), "") == 0, "serve_runtime_backend(NULL) is not \"\"");
  CHECK(serve_error_code(NULL) == SERVE_CODE_OK, "serve_error_code(NULL) is not OK");
  CHECK(strcmp(serve_error_message(NULL), "") == 0, "serve_error_message(NULL) is not \"\"");
}

/* ---------------------------------------------------------------------------------------------
 * Recurrent models: lstm (token sequences) and treelstm (trees)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
  size_t n;          /* tokens (and parents, for trees) */
  uint32_t *tokens;
  int32_t *parents;  /* NULL for sequences */
  size_t out_len;
  float *out;
} rec_case;

typedef struct {
  rec_case *lstm, *tree;
  size_t n_lstm, n_tree;
} rec_cases;

static void free_cases(rec_case *c, size_t n) {
  for (size_t i = 0; c && i < n; i++) {
    free(c[i].tokens);
    free(c[i].parents);
    free(c[i].out);
  }
  free(c);
}

static bool read_case_list(FILE *f, const char *label, bool tree, rec_case **out, size_t *count) {
  char word[16];
  size_t k = 0;
  if (fscanf(f, "%15s %zu", word, &k) != 2 || strcmp(word, label) != 0 || k == 0 || k > 10000)
    return false;
  rec_case *c = calloc(k, sizeof *c);
  if (c == NULL) return false;
  *out = c;
  *count = k;
  for (size_t i = 0; i < k; i++) {
    if (fscanf(f, "%zu", &c[i].n) != 1 || c[i].n == 0 || c[i].n > 100000) return false;
    c[i].tokens = calloc(c[i].n, sizeof(uint32_t));
    if (c[i].tokens == NULL) return false;
    for (size_t j = 0; j < c[i].n; j++)
      if (fscanf(f, "%" SCNu32, &c[i].tokens[j]) != 1) return false;
    if (tree) {
      c[i].parents = calloc(c[i].n, sizeof(int32_t));
      if (c[i].parents == NULL) return false;
      for (size_t j = 0; j < c[i].n; j++)
        if (fscanf(f, "%" SCNd32, &c[i].parents[j]) != 1) return false;
    }
    if (fscanf(f, "%zu", &c[i].out_len) != 1 || c[i].out_len == 0 || c[i].out_len > 100000)
      return false;
    c[i].out = calloc(c[i].out_len, sizeof(float));
    if (c[i].out == NULL) return false;
    for (size_t j = 0; j < c[i].out_len; j++)
      if (fscanf(f, "%f", &c[i].out[j]) != 1) return false;
  }
  return true;
}

static bool read_recurrent(const char *path, rec_cases *r) {
  memset(r, 0, sizeof *r);
  FILE *f = fopen(path, "r");
  if (f == NULL) {
    fail("cannot open %s", path);
    return false;
  }
  bool good = read_case_list(f, "LSTM", false, &r->lstm, &r->n_lstm) &&
              read_case_list(f, "TREE", true, &r->tree, &r->n_tree);
  fclose(f);
  if (!good) fail("%s is malformed (see the format at the top of example.c)", path);
  return good;
}

/* Check an f32 completion against a recurrent case. */
static void check_rec_output(const serve_completion *c, const rec_case *want, const char *what) {
  serve_code code = serve_completion_code(c);
  if (code != SERVE_CODE_OK) {
    const char *m = serve_completion_message(c);
    fail("%s: tag %" PRIu64 " completed %s: %s", what, serve_completion_tag(c),
         serve_code_name((uint32_t)code), m ? m : "(no message)");
    return;
  }
  const float *data = NULL;
  size_t len = 0;
  if (!ok(serve_completion_output_f32(c, &data, &len), what)) return;
  if (len != want->out_len) {
    fail("%s: output has %zu values, expected %zu", what, len, want->out_len);
    return;
  }
  for (size_t j = 0; j < len; j++) {
    float tol = 1e-4f * (absf(want->out[j]) > 1.0f ? absf(want->out[j]) : 1.0f);
    if (!(absf(data[j] - want->out[j]) <= tol)) {
      fail("%s: tag %" PRIu64 " output[%zu] = %.9g, expected %.9g", what, serve_completion_tag(c),
           j, (double)data[j], (double)want->out[j]);
      return;
    }
  }
}

/* Load `dir` with `policy` (2 workers for cellular) or report why not. */
static serve_model *load_recurrent(const serve_runtime *rt, const char *dir, uint32_t policy,
                                   const char *what) {
  serve_model_options *mo = NULL;
  serve_model *m = NULL;
  if (!ok(serve_model_options_new(&mo), "serve_model_options_new")) return NULL;
  ok(serve_model_options_set_policy(mo, policy), "serve_model_options_set_policy");
  if (policy == SERVE_POLICY_CELLULAR) {
    ok(serve_model_options_set_workers(mo, 2), "serve_model_options_set_workers");
    ok(serve_model_options_set_max_tasks_to_submit(mo, 2),
       "serve_model_options_set_max_tasks_to_submit");
  } else {
    /* Padding runs an lstm unfolded (no token-gate table); cellular with the default one. */
    ok(serve_model_options_set_token_gates_bytes(mo, 0),
       "serve_model_options_set_token_gates_bytes");
  }
  ok(serve_runtime_load_model(rt, dir, mo, &m), what);
  serve_model_options_free(mo);
  return m;
}

static void run_recurrent_phase(const serve_runtime *rt, const char *lstm_dir,
                                const char *tree_dir, const rec_cases *r, uint64_t *good) {
  /* Options that do not fit the model's kind: refused when it is known (values that are never
     valid are checked with the other option setters, in main). */
  serve_model_options *mo = NULL;
  ok(serve_model_options_new(&mo), "serve_model_options_new");
  serve_model *m = SENTINEL_PTR(serve_model);
  ok(serve_model_options_set_policy(mo, SERVE_POLICY_TIMEOUT), "serve_model_options_set_policy");
  expect_code(serve_runtime_load_model(rt, lstm_dir, mo, &m), SERVE_CODE_UNSUPPORTED,
              "timeout batching for an lstm");
  ok(serve_model_options_set_policy(mo, SERVE_POLICY_CELLULAR), "serve_model_options_set_policy");
  ok(serve_model_options_set_max_wait_ns(mo, 1000), "serve_model_options_set_max_wait_ns");
  expect_code(serve_runtime_load_model(rt, lstm_dir, mo, &m), SERVE_CODE_INVALID_ARGUMENT,
              "a max wait under cellular batching");
  CHECK(m == SENTINEL_PTR(serve_model), "serve_runtime_load_model wrote *out on error");
  serve_model_options_free(mo);

  const uint32_t policies[2] = {SERVE_POLICY_CELLULAR, SERVE_POLICY_PADDING};
  for (int p = 0; p < 2; p++) {
    const char *pname = p == 0 ? "cellular" : "padding";
    serve_model *lstm = load_recurrent(rt, lstm_dir, policies[p], "load the lstm");
    serve_model *tree = load_recurrent(rt, tree_dir, policies[p], "load the treelstm");
    serve_queue *q = NULL;
    if (lstm == NULL || tree == NULL || !ok(serve_queue_new(&q), "serve_queue_new")) {
      serve_model_free(lstm);
      serve_model_free(tree);
      return;
    }
    CHECK(strcmp(serve_model_kind(lstm), "lstm") == 0, "kind %s", serve_model_kind(lstm));
    CHECK(strcmp(serve_model_kind(tree), "treelstm") == 0, "kind %s", serve_model_kind(tree));
    CHECK(serve_model_input_len(lstm) == 0, "an lstm has no fixed input length");
    CHECK(serve_model_output_len(lstm) == r->lstm[0].out_len, "lstm output length %zu",
          serve_model_output_len(lstm));

    /* Every case twice, all in flight together. Tags: 2·case (+1 for the copy), trees + 10000. */
    size_t want = 0;
    for (int copy = 0; copy < 2; copy++) {
      for (size_t i = 0; i < r->n_lstm; i++)
        if (ok(serve_submit_tokens(lstm, q, 2 * i + copy, r->lstm[i].tokens, r->lstm[i].n, NULL,
                                   NULL),
               "serve_submit_tokens"))
          want++;
      for (size_t i = 0; i < r->n_tree; i++)
        if (ok(serve_submit_tree(tree, q, 10000 + 2 * i + copy, r->tree[i].tokens,
                                 r->tree[i].parents, r->tree[i].n, NULL, NULL),
               "serve_submit_tree"))
          want++;
    }
    /* Bad requests are refused with INVALID_ARGUMENT; the ones in flight are unaffected. */
    const uint32_t out_of_vocab[2] = {1, 4000000000u};
    expect_code(serve_submit_tokens(lstm, q, 1, out_of_vocab, 2, NULL, NULL),
                SERVE_CODE_INVALID_ARGUMENT, "a token outside the vocabulary");
    expect_code(serve_submit_tokens(lstm, q, 1, out_of_vocab, 0, NULL, NULL),
                SERVE_CODE_INVALID_ARGUMENT, "an empty sequence");
    const uint32_t toks[3] = {1, 2, 3};
    const int32_t two_roots[3] = {-1, 0, -1};
    const int32_t cycle[3] = {-1, 2, 1};
    const int32_t out_of_range[3] = {-1, 0, 3};
    expect_code(serve_submit_tree(tree, q, 1, toks, two_roots, 3, NULL, NULL),
                SERVE_CODE_INVALID_ARGUMENT, "a tree with two roots");
    expect_code(serve_submit_tree(tree, q, 1, toks, cycle, 3, NULL, NULL),
                SERVE_CODE_INVALID_ARGUMENT, "a tree with a cycle");
    expect_code(serve_submit_tree(tree, q, 1, toks, out_of_range, 3, NULL, NULL),
                SERVE_CODE_INVALID_ARGUMENT, "a parent out of range");
    expect_code(serve_submit_tree(tree, q, 1, toks, NULL, 3, NULL, NULL),
                SERVE_CODE_INVALID_ARGUMENT, "a tree without parents");
    const float f[1] = {0};
    expect_code(serve_submit_f32(lstm, q, 1, f, 1, NULL, NULL), SERVE_CODE_INVALID_ARGUMENT,
                "f32 input to an lstm");

    size_t got = 0;
    while (got < want) {
      serve_completion *c[16];
      size_t n = 0;
      if (!ok(serve_queue_next(q, c, 16, ms_to_ns(30000), &n), "serve_queue_next") || n == 0) {
        fail("%s: %zu of %zu recurrent requests completed", pname, got, want);
        break;
      }
      for (size_t i = 0; i < n; i++) {
        uint64_t tag = serve_completion_tag(c[i]);
        if (tag >= 10000 && (tag - 10000) / 2 < r->n_tree)
          check_rec_output(c[i], &r->tree[(tag - 10000) / 2], pname);
        else if (tag < 10000 && tag / 2 < r->n_lstm)
          check_rec_output(c[i], &r->lstm[tag / 2], pname);
        else
          fail("%s: unexpected tag %" PRIu64, pname, tag);
        serve_completion_free(c[i]);
      }
      got += n;
    }
    *good += got;
    serve_queue_free(q);
    serve_model_free(lstm);
    serve_model_free(tree);
  }
}

/* ---------------------------------------------------------------------------------------------
 * Cancel and deadline on a model that holds requests back (long batching wait)
 * ------------------------------------------------------------------------------------------- */

/* Wait for exactly one completion on `q` (up to 30 s; `*arrived` = when) and check nothing else
 * follows. */
static serve_completion *wait_one(const serve_queue *q, const char *what, uint64_t *arrived) {
  serve_completion *c[2] = {NULL, NULL};
  size_t n = 0;
  if (!ok(serve_queue_next(q, c, 2, ms_to_ns(30000), &n), what)) return NULL;
  *arrived = serve_now_ns();
  if (n != 1) {
    fail("%s: expected 1 completion within 30 s, got %zu", what, n);
    for (size_t i = 0; i < n; i++) serve_completion_free(c[i]);
    return NULL;
  }
  serve_completion *extra[1] = {NULL};
  size_t m = 0;
  if (ok(serve_queue_next(q, extra, 1, ms_to_ns(100), &m), what)) {
    CHECK(m == 0, "%s: completed more than once", what);
    if (m) serve_completion_free(extra[0]);
  }
  return c[0];
}

static void run_cancel_and_deadline(const serve_runtime *rt, const serve_model *slow,
                                    const expected *e, uint64_t *cancelled_or_expired) {
  serve_queue *q = NULL;
  if (!ok(serve_queue_new(&q), "serve_queue_new")) return;

  /* Cancel: the request waits up to 10 s for a fuller batch, so it is still queued. */
  uint64_t id = SENTINEL_U64;
  if (ok(serve_submit_f32(slow, q, 42, e->inputs, e->in_len, NULL, &id), "submit (cancel)")) {
    uint64_t t0 = serve_now_ns();
    ok(serve_runtime_cancel(rt, id), "serve_runtime_cancel");
    uint64_t t1 = 0;
    serve_completion *c = wait_one(q, "cancelled request", &t1);
    if (c) {
      serve_code code = serve_completion_code(c);
      CHECK(serve_completion_tag(c) == 42 && serve_completion_request_id(c) == id,
            "cancelled request: wrong tag/id");
      if (code == SERVE_CODE_CANCELLED) {
        (*cancelled_or_expired)++;
        const char *m = serve_completion_message(c);
        CHECK(m != NULL && m[0] != '\0', "a CANCELLED completion has no message");
        const float *d = SENTINEL_PTR(const float);
        size_t l = SENTINEL_SIZE;
        expect_code(serve_completion_output_f32(c, &d, &l), SERVE_CODE_CANCELLED,
                    "serve_completion_output_f32 on a cancelled request");
        CHECK(d == SENTINEL_PTR(const float) && l == SENTINEL_SIZE,
              "serve_completion_output_f32 wrote out-parameters on error");
      } else if (code == SERVE_CODE_OK) {
        check_output(e, c, 0, "cancelled request that won the race");
      } else {
        fail("cancelled request completed %s", serve_code_name((uint32_t)code));
      }
      printf("cancel: completed %s after %.1f ms\n", serve_code_name((uint32_t)code),
             (double)(t1 - t0) / 1e6);
      serve_completion_free(c);
      /* Cancelling an id that already completed is not an error. */
      ok(serve_runtime_cancel(rt, id), "serve_runtime_cancel of a completed request");
    }
  }

  /* Deadline: 50 ms, while the request waits 10 s for a batch. */
  serve_submit_options *o = NULL;
  if (ok(serve_submit_options_new(&o), "serve_submit_options_new")) {
    ok(serve_submit_options_set_deadline_ns(o, serve_now_ns() + ms_to_ns(50)),
       "serve_submit_options_set_deadline_ns");
    if (ok(serve_submit_f32(slow, q, 43, e->inputs, e->in_len, o, NULL), "submit (deadline)")) {
      uint64_t t1 = 0;
      serve_completion *c = wait_one(q, "request with a 50 ms deadline", &t1);
      if (c) {
        serve_code code = serve_completion_code(c);
        CHECK(code == SERVE_CODE_DEADLINE_EXCEEDED,
              "request with a 50 ms deadline completed %s, expected DEADLINE_EXCEEDED",
              serve_code_name((uint32_t)code));
        if (code == SERVE_CODE_DEADLINE_EXCEEDED) (*cancelled_or_expired)++;
        serve_completion_free(c);
      }
    }
    serve_submit_options_free(o);
  }
  serve_queue_free(q);
}

/* ---------------------------------------------------------------------------------------------
 * main
 * ------------------------------------------------------------------------------------------- */

static serve_stats *take_stats(const serve_runtime *rt) {
  serve_stats *st = NULL;
  if (!ok(serve_runtime_stats(rt, &st), "serve_runtime_stats")) return NULL;
  return st;
}

/* Metrics: OpenMetrics text holding example-mlp's completed-OK counter (at least the correct
 * outputs seen), ending with "# EOF". */
static void check_metrics(const serve_runtime *rt, uint64_t good_mlp) {
  serve_metrics *m = SENTINEL_PTR(serve_metrics);
  expect_code(serve_runtime_metrics(NULL, &m), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_metrics(NULL)");
  expect_code(serve_runtime_metrics(rt, NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_metrics(NULL out)");
  CHECK(m == SENTINEL_PTR(serve_metrics), "serve_runtime_metrics wrote *out on error");
  size_t len = 1;
  CHECK(strcmp(serve_metrics_text(NULL, &len), "") == 0 && len == 0, "serve_metrics_text(NULL)");
  if (!ok(serve_runtime_metrics(rt, &m), "serve_runtime_metrics")) return;
  const char *text = serve_metrics_text(m, &len);
  CHECK(text != NULL && strlen(text) == len, "serve_metrics_text: length %zu", len);
  const char *sample = "\nserve_requests_completed_total{model=\"example-mlp\",code=\"OK\"} ";
  const char *at = text ? strstr(text, sample) : NULL;
  double okc = at ? strtod(at + strlen(sample), NULL) : -1;
  CHECK(okc >= (double)good_mlp, "metrics: example-mlp completed OK %g, want at least %" PRIu64,
        okc, good_mlp);
  const char *eof = "\n# EOF\n";
  CHECK(text != NULL && len >= strlen(eof) && strcmp(text + len - strlen(eof), eof) == 0,
        "metrics: the text does not end with # EOF");
  serve_metrics_free(m);
}

int main(int argc, char **argv) {
  if (argc != 3 && argc != 6) {
    fprintf(stderr, "usage: %s MODEL_DIR EXPECTED_FILE [LSTM_DIR TREELSTM_DIR RECURRENT_FILE]\n",
            argv[0]);
    return 2;
  }
  const char *model_dir = argv[1];
  setvbuf(stdout, NULL, _IOLBF, 0);

  /* Version: the header compiled against must match the linked library. */
  char want_version[64];
  snprintf(want_version, sizeof want_version, "%d.%d.%d", SERVE_VERSION_MAJOR, SERVE_VERSION_MINOR,
           SERVE_VERSION_PATCH);
  const char *version = serve_version();
  if (version == NULL || strcmp(version, want_version) != 0) {
    fail("serve_version() = %s but the header says %s", version ? version : "(null)",
         want_version);
    return 1; /* nothing else is meaningful against a mismatched library */
  }
  CHECK(strcmp(serve_code_name(SERVE_CODE_BUSY), "BUSY") == 0, "serve_code_name(BUSY)");
  CHECK(strcmp(serve_code_name(SERVE_CODE_INVALID_ARGUMENT), "INVALID_ARGUMENT") == 0,
        "serve_code_name(INVALID_ARGUMENT)");
  CHECK(strcmp(serve_code_name(9999), "UNKNOWN") == 0, "serve_code_name(9999)");

  /* _free(NULL) is allowed for every type. */
  serve_completion_free(NULL);
  serve_error_free(NULL);
  serve_model_options_free(NULL);
  serve_model_free(NULL);
  serve_queue_free(NULL);
  serve_runtime_options_free(NULL);
  serve_runtime_free(NULL);
  serve_stats_free(NULL);
  serve_metrics_free(NULL);
  serve_submit_options_free(NULL);

  expected e;
  if (!read_expected(argv[2], &e)) return 1;

  /* Runtime. */
  serve_runtime_options *ro = SENTINEL_PTR(serve_runtime_options);
  expect_code(serve_runtime_options_new(NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_options_new(NULL)");
  if (!ok(serve_runtime_options_new(&ro), "serve_runtime_options_new")) return 1;
  expect_code(serve_runtime_options_set_backend(ro, "tpu"), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_options_set_backend(\"tpu\")");
  expect_code(serve_runtime_options_set_backend(ro, NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_options_set_backend(NULL)");
  expect_code(serve_runtime_options_set_admission_bound(ro, 0), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_options_set_admission_bound(0)");
  ok(serve_runtime_options_set_backend(ro, "cpu"), "serve_runtime_options_set_backend");
  ok(serve_runtime_options_set_cpu_threads(ro, 2), "serve_runtime_options_set_cpu_threads");
  /* Small enough that 4 submitting threads meet BUSY now and then. */
  ok(serve_runtime_options_set_admission_bound(ro, 64), "serve_runtime_options_set_admission_bound");
  serve_runtime *rt = SENTINEL_PTR(serve_runtime);
  expect_code(serve_runtime_new(ro, NULL), SERVE_CODE_INVALID_ARGUMENT, "serve_runtime_new(NULL)");
  if (!ok(serve_runtime_new(ro, &rt), "serve_runtime_new")) {
    serve_runtime_options_free(ro);
    free_expected(&e);
    return 1;
  }
  serve_runtime_options_free(ro); /* only read by serve_runtime_new */
  CHECK(strcmp(serve_runtime_backend(rt), "cpu") == 0, "backend is %s, expected cpu",
        serve_runtime_backend(rt));

  /* Model loading: a missing directory, then the real one. */
  char missing[4096];
  snprintf(missing, sizeof missing, "%s/does-not-exist", model_dir);
  serve_model *model = SENTINEL_PTR(serve_model);
  expect_code(serve_runtime_load_model(rt, missing, NULL, &model), SERVE_CODE_NOT_FOUND,
              "serve_runtime_load_model(missing directory)");
  CHECK(model == SENTINEL_PTR(serve_model), "serve_runtime_load_model wrote *out on error");
  expect_code(serve_runtime_load_model(NULL, model_dir, NULL, &model),
              SERVE_CODE_INVALID_ARGUMENT, "serve_runtime_load_model(NULL runtime)");
  expect_code(serve_runtime_load_model(rt, NULL, NULL, &model), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_load_model(NULL dir)");
  expect_code(serve_runtime_load_model(rt, model_dir, NULL, NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_runtime_load_model(NULL out)");
  CHECK(model == SENTINEL_PTR(serve_model), "serve_runtime_load_model wrote *out on error");

  serve_model_options *mo = NULL;
  ok(serve_model_options_new(&mo), "serve_model_options_new");
  expect_code(serve_model_options_set_max_batch(mo, 0), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_max_batch(0)");
  expect_code(serve_model_options_set_workers(mo, 0), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_workers(0)");
  expect_code(serve_model_options_set_admission_bound(mo, 0), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_admission_bound(0)");
  expect_code(serve_model_options_set_name(mo, NULL), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_name(NULL)");
  expect_code(serve_model_options_set_policy(mo, 99), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_policy(99)");
  expect_code(serve_model_options_set_max_tasks_to_submit(mo, 0), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_max_tasks_to_submit(0)");
  expect_code(serve_model_options_set_state_slots(mo, 0), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_state_slots(0)");
  expect_code(serve_model_options_set_max_batch(NULL, 4), SERVE_CODE_INVALID_ARGUMENT,
              "serve_model_options_set_max_batch(NULL options)");
  ok(serve_model_options_set_max_batch(mo, 16), "serve_model_options_set_max_batch");
  ok(serve_model_options_set_workers(mo, 2), "serve_model_options_set_workers");
  ok(serve_model_options_set_max_wait_ns(mo, 200000), "serve_model_options_set_max_wait_ns");
  ok(serve_model_options_set_name(mo, "example-mlp"), "serve_model_options_set_name");
  if (!ok(serve_runtime_load_model(rt, model_dir, mo, &model), "serve_runtime_load_model")) {
    serve_model_options_free(mo);
    serve_runtime_free(rt);
    free_expected(&e);
    return 1;
  }
  /* A second handle on the same weights that holds requests back for 10 s to form a batch. */
  serve_model *slow = NULL;
  ok(serve_model_options_set_name(mo, "example-mlp-slow"), "serve_model_options_set_name");
  ok(serve_model_options_set_max_batch(mo, 64), "serve_model_options_set_max_batch");
  ok(serve_model_options_set_workers(mo, 1), "serve_model_options_set_workers");
  ok(serve_model_options_set_max_wait_ns(mo, ms_to_ns(10000)),
     "serve_model_options_set_max_wait_ns");
  ok(serve_model_options_set_admission_bound(mo, 1000),
     "serve_model_options_set_admission_bound");
  ok(serve_runtime_load_model(rt, model_dir, mo, &slow), "serve_runtime_load_model (slow)");
  serve_model_options_free(mo);

  CHECK(strcmp(serve_model_kind(model), "mlp") == 0, "model kind is %s, expected mlp",
        serve_model_kind(model));
  CHECK(serve_model_input_len(model) == e.in_len, "model input length %zu, expected %zu",
        serve_model_input_len(model), e.in_len);
  CHECK(serve_model_output_len(model) == e.out_len, "model output length %zu, expected %zu",
        serve_model_output_len(model), e.out_len);
  if (serve_model_input_len(model) != e.in_len || serve_model_output_len(model) != e.out_len) {
    serve_model_free(model);
    serve_model_free(slow);
    serve_runtime_free(rt);
    free_expected(&e);
    return 1;
  }

  serve_queue *queue = NULL;
  ok(serve_queue_new(&queue), "serve_queue_new");

  uint64_t good = 0, rejects = 0, cancelled_or_expired = 0;
  run_concurrent_phase(model, queue, &e, &good);
  run_bad_requests(rt, model, queue, &e, &rejects);
  if (slow) run_cancel_and_deadline(rt, slow, &e, &cancelled_or_expired);
  run_callback_phase(model, &e, &good);
  const uint64_t good_mlp = good; /* correct outputs of example-mlp */
  if (argc == 6) {
    rec_cases rc;
    if (read_recurrent(argv[5], &rc)) run_recurrent_phase(rt, argv[3], argv[4], &rc, &good);
    free_cases(rc.lstm, rc.n_lstm);
    free_cases(rc.tree, rc.n_tree);
  }

  /* Stats: everything submitted has completed (counters are updated before delivery). */
  serve_stats *st = take_stats(rt);
  if (st) {
    uint64_t sub = serve_stats_submitted(st), total = serve_stats_completed_total(st);
    uint64_t okc = serve_stats_completed(st, SERVE_CODE_OK);
    uint64_t canc = serve_stats_completed(st, SERVE_CODE_CANCELLED) +
                    serve_stats_completed(st, SERVE_CODE_DEADLINE_EXCEEDED);
    printf("stats: submitted %" PRIu64 ", completed %" PRIu64 " (OK %" PRIu64 "), rejected %" PRIu64
           ", tasks %" PRIu64 ", batched requests %" PRIu64 "\n",
           sub, total, okc, serve_stats_rejected(st), serve_stats_tasks_launched(st),
           serve_stats_batched_requests(st));
    CHECK(total == sub, "stats: completed_total %" PRIu64 " != submitted %" PRIu64, total, sub);
    CHECK(okc >= good, "stats: completed OK %" PRIu64 " < good requests %" PRIu64, okc, good);
    CHECK(okc + canc <= total, "stats: per-code counts exceed the total");
    CHECK(canc >= cancelled_or_expired, "stats: %" PRIu64 " CANCELLED/DEADLINE_EXCEEDED counted, "
          "%" PRIu64 " seen", canc, cancelled_or_expired);
    CHECK(serve_stats_rejected(st) >= rejects, "stats: rejected %" PRIu64 " < %" PRIu64
          " refused submits", serve_stats_rejected(st), rejects);
    CHECK(serve_stats_in_flight(st) == 0 && serve_stats_queued(st) == 0 &&
              serve_stats_running(st) == 0,
          "stats: in flight %" PRIu64 ", queued %" PRIu64 ", running %" PRIu64 " after draining",
          serve_stats_in_flight(st), serve_stats_queued(st), serve_stats_running(st));
    CHECK(serve_stats_tasks_launched(st) >= 1 &&
              serve_stats_tasks_launched(st) <= serve_stats_batched_requests(st) &&
              serve_stats_batched_requests(st) >= okc,
          "stats: tasks %" PRIu64 ", batched requests %" PRIu64 ", OK %" PRIu64 " inconsistent",
          serve_stats_tasks_launched(st), serve_stats_batched_requests(st), okc);
    CHECK(serve_stats_completed(st, 9999) == 0, "stats: completed(unknown code) != 0");
    serve_stats_free(st);
  }

  /* Shutdown with requests pending: they complete (CANCELLED, or OK if drained) exactly once. */
  enum { PENDING = 5 };
  unsigned pending = 0;
  for (unsigned i = 0; slow && i < PENDING; i++)
    if (ok(serve_submit_f32(slow, queue, 1000 + i, e.inputs, e.in_len, NULL, NULL),
           "submit before shutdown"))
      pending++;
  ok(serve_runtime_shutdown(rt, ms_to_ns(100)), "serve_runtime_shutdown");
  ok(serve_runtime_shutdown(rt, 0), "serve_runtime_shutdown (again)");
  {
    serve_completion *c[PENDING + 1];
    size_t n = 0, got = 0;
    unsigned seen[PENDING] = {0};
    while (got < pending + 1 &&
           ok(serve_queue_next(queue, c, PENDING + 1, ms_to_ns(got < pending ? 10000 : 100), &n),
              "serve_queue_next after shutdown") &&
           n > 0) {
      for (size_t i = 0; i < n; i++) {
        uint64_t tag = serve_completion_tag(c[i]);
        serve_code code = serve_completion_code(c[i]);
        if (tag < 1000 || tag >= 1000 + PENDING)
          fail("after shutdown: unexpected tag %" PRIu64, tag);
        else
          seen[tag - 1000]++;
        if (code == SERVE_CODE_OK)
          check_output(&e, c[i], 0, "request drained by shutdown");
        else
          CHECK(code == SERVE_CODE_CANCELLED, "pending request completed %s at shutdown",
                serve_code_name((uint32_t)code));
        serve_completion_free(c[i]);
      }
      got += n;
    }
    CHECK(got == pending, "shutdown: %zu completions for %u pending requests", got, pending);
    for (unsigned i = 0; i < PENDING; i++)
      CHECK(seen[i] <= 1, "shutdown: tag %u completed %u times", 1000 + i, seen[i]);
  }
  uint64_t id = SENTINEL_U64;
  expect_code(serve_submit_f32(model, queue, 7, e.inputs, e.in_len, NULL, &id),
              SERVE_CODE_SHUTDOWN, "submit after shutdown");
  CHECK(id == SENTINEL_U64, "submit after shutdown wrote *request_id");
  serve_model *late = SENTINEL_PTR(serve_model);
  expect_code(serve_runtime_load_model(rt, model_dir, NULL, &late), SERVE_CODE_SHUTDOWN,
              "serve_runtime_load_model after shutdown");
  CHECK(late == SENTINEL_PTR(serve_model), "serve_runtime_load_model wrote *out on error");
  st = take_stats(rt);
  if (st) {
    CHECK(serve_stats_completed_total(st) == serve_stats_submitted(st),
          "stats after shutdown: completed_total %" PRIu64 " != submitted %" PRIu64,
          serve_stats_completed_total(st), serve_stats_submitted(st));
    serve_stats_free(st);
  }

  check_metrics(rt, good_mlp);

  /* A model handle outlives its runtime; it then refuses requests with SHUTDOWN. */
  serve_runtime_free(rt);
  if (slow)
    expect_code(serve_submit_f32(slow, queue, 8, e.inputs, e.in_len, NULL, NULL),
                SERVE_CODE_SHUTDOWN, "submit after serve_runtime_free");
  serve_model_free(slow);
  serve_model_free(model);
  serve_queue_free(queue);
  free_expected(&e);

  int failures = atomic_load(&g_failures);
  if (failures != 0) {
    printf("example: %d check(s) failed\n", failures);
    return 1;
  }
  printf("example: all checks passed\n");
  return 0;
}
