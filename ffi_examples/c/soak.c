/*
 * soak.c — a long-running load test of libserve through its C ABI (include/libserve.h only).
 *
 * Usage: soak [OPTIONS] [MODEL_DIR...]
 *
 *   MODEL_DIR   model directories (model.toml + weights.safetensors) of any kind: mlp, lstm,
 *               seq2seq, treelstm. At most 16. Default: ffi_examples/testdata/mlp_4_8_3 and
 *               ffi_examples/testdata/lstm_small (relative to the working directory).
 *
 *   --seconds S             length of the open-loop run (default 1800)
 *   --load F                offered load as a fraction of the measured capacity (default 0.8)
 *   --max-growth PCT        most RSS growth allowed from the end of warm-up to the end (default 1)
 *   --sample-seconds S      RSS / progress sample period (default 10)
 *   --warmup-seconds S      warm-up before the RSS baseline (default 60, or 10% of --seconds if
 *                           that is shorter)
 *   --calibrate-seconds S   closed-loop calibration per model (default 5)
 *   --prime-seconds S       overload burst before the run (default 10, or 5% of --seconds if
 *                           that is shorter; 0: none)
 *   --window N              outstanding requests during calibration (default 128)
 *   --admission-bound N     each model's admission bound (default 4096, the runtime's default)
 *   --backend B             auto, cpu or cuda (default auto)
 *   --cpu-threads N         CPU backend compute threads, 0 = one per core (default 0)
 *   --max-seq N             longest token sequence / tree generated (default 16)
 *   --seed N                random seed (default 1)
 *
 * What it does. Loads every model into one runtime with one completion queue. Calibrates each
 * model's capacity: one submitter keeps --window requests outstanding for --calibrate-seconds
 * while a consumer thread drains the queue; completions/s over the last 80% of that time is the
 * capacity. Models are mixed with equal probability, so the mix's capacity is the harmonic
 * combination n / sum(1 / capacity_i). Then one submitter thread offers an open-loop Poisson
 * arrival process at --load times that capacity for --seconds; a refused submit (BUSY, ...) is
 * counted, never retried. The consumer keeps an exactly-once ledger (every accepted request's tag
 * completes exactly once, with the request id submit returned; none twice, none lost), counts
 * completions by code and checks every OK output (f32: the model's output length, all finite;
 * tokens: 1 to max_decode ids below the vocabulary). The main thread samples this process's RSS
 * (/proc/self/statm) every --sample-seconds and prints a `sample` line; RSS growth is measured
 * from the end of warm-up to the end of the run. Beside RSS each line gives, where the C library
 * is glibc, the heap in use (`heap`: bytes malloc has handed out and not had back) and held
 * (`held`: what its arenas hold from the system, free chunks included): RSS growing while `heap`
 * stays flat is the allocator keeping memory, not the program's live memory growing. glibc's
 * per-thread arenas do that under a producer/consumer load (each thread's arena keeps its own
 * high-water mark); `MALLOC_ARENA_MAX=1` in the environment gives them one arena. At the end,
 * `rss by mapping` and up to 12 `rss change` lines say where RSS changed between warm-up and the
 * end, mapping by mapping (/proc/self/smaps: a glibc arena, the heap, a large block of its own,
 * a library's code), largest change first (soak_mem.h).
 * Each line also gives the interval's backlog peak:
 * the most requests accepted and not yet settled by the consumer, seen at a submit. A request
 * holds its admission place until its completion is freed, so the backlog never exceeds the sum
 * of the admission bounds, and neither does what the runtime holds for it. Before the run, a
 * priming pass takes the runtime through the worst the bounds allow, so that the RSS baseline
 * already holds the high-water marks of its queues and maps (and of the allocator's arenas) and
 * an overload episode during the run cannot grow them further: first it fills every model to its
 * bound at once, in turns, with the consumer paused (the completions pile up in the queue too);
 * then, with the consumer running, it submits to the models in turns as fast as one thread can
 * for --prime-seconds, so the engine falls behind and holds every model's bound together, as it
 * does when the machine stalls under load. The submitter thread primes, so that its own malloc
 * arena (the runtime copies each request's input on the caller's thread) reaches its high too.
 * Filling one model after another is not enough: the engine's request tables are shared by the
 * models, and a 3-minute run at load 1.3 after such a priming still grew RSS by 3.4 MiB in its
 * first seconds; priming from the main thread left the submitter's arena to grow under
 * glibc's default arenas, by 2.8 MiB in the run's first 10 s and 0.9 MiB more after warm-up.
 * At the end: shutdown with drain, then every
 * request must have completed OK, nothing may be pending (ledger and serve_runtime_stats), and
 * every handle is freed.
 *
 * Request inputs are drawn from a small pool generated at start (mlp: values in [-2, 2]; token
 * ids below the model.toml `vocab`; lengths 1 to min(--max-seq, max_len / max_nodes)), so the
 * client allocates nothing per request.
 *
 * Output: `calibrate`, `soak`, `sample` and `warm-up` lines, then `soak summary: ...` and either
 * `soak: ok` (exit 0) or `soak: FAILED` (exit 1) — failed when the RSS growth is over the limit,
 * the ledger is violated, a request completed with a code other than OK, a submit was refused
 * with a code other than BUSY, or an output was malformed. Exit 2: bad command line or setup.
 *
 * Build (what scripts/soak.sh and tests/soak_program.rs do):
 *   cc -std=c11 -Wall -Wextra -Werror -pthread -I include ffi_examples/c/soak.c \
 *     -L target/release -lserve -lm -o soak
 *   run with libserve.so.0 (the SONAME) on LD_LIBRARY_PATH.
 */

#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h> /* mallinfo2 */
#endif

#include "libserve.h"
#include "check.h"
#include "soak_mem.h"

enum {
  MAX_MODELS = 16,   /* a tag's low 4 bits name the model */
  POOL = 64,         /* pre-generated inputs per model */
  CODES = 16,        /* completion counters; serve_code values above 14 count in the last */
  DRAIN_BATCH = 256, /* completions taken per serve_queue_next */
  MAX_TOML = 1 << 20 /* model.toml size limit (libserve's own) */
};
#define NS_PER_S 1000000000.0
#define DRAIN_TIMEOUT_NS (60ull * 1000000000ull)

/* ---------------------------------------------------------------------------------------------
 * Time, random numbers (failures: check.h; memory: soak_mem.h)
 * ------------------------------------------------------------------------------------------- */

static uint64_t now_ns(void) { return serve_now_ns(); }

static void sleep_until_ns(uint64_t t) {
  struct timespec ts = {.tv_sec = (time_t)(t / 1000000000u), .tv_nsec = (long)(t % 1000000000u)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

/* xorshift64*: the client's only randomness (one generator per thread). */
static uint64_t rng_next(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1Dull;
}
static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; } /* [0,1) */
static uint64_t rng_below(uint64_t *s, uint64_t n) { return rng_next(s) % n; }

/* The command line: config, usage() and parse_args(). */
#include "soak_cli.h"

/* ---------------------------------------------------------------------------------------------
 * Models and their request pools
 * ------------------------------------------------------------------------------------------- */

typedef enum { KIND_MLP, KIND_LSTM, KIND_SEQ2SEQ, KIND_TREE } kind;

typedef struct {
  const char *dir;
  serve_model *m;
  kind k;
  size_t in_len, out_len;       /* mlp input; f32 output length (0 for seq2seq) */
  uint64_t vocab, max_decode;   /* from model.toml (recurrent kinds) */
  size_t lens[POOL];            /* pool request i: lens[i] values or tokens or nodes */
  float *f32;                   /* POOL * in_len */
  uint32_t *tokens;             /* POOL * stride */
  int32_t *parents;             /* POOL * stride (trees) */
  size_t stride;
  double capacity;              /* completions/s, closed loop */
} model_t;

/* The integer value of `key = N` in model.toml, if present (other lines are ignored). */
static bool toml_int(const char *dir, const char *key, uint64_t *out) {
  char path[4096], line[512];
  if (snprintf(path, sizeof path, "%s/model.toml", dir) >= (int)sizeof path) return false;
  FILE *f = fopen(path, "r");
  if (f == NULL) return false;
  bool found = false;
  size_t read = 0, klen = strlen(key);
  while (!found && read < MAX_TOML && fgets(line, sizeof line, f) != NULL) {
    read += strlen(line);
    const char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (strncmp(p, key, klen) != 0) continue;
    p += klen;
    while (*p == ' ' || *p == '\t') p++;
    if (*p++ != '=') continue;
    while (*p == ' ' || *p == '\t') p++;
    char *end = NULL;
    errno = 0;
    unsigned long long v = (*p >= '0' && *p <= '9') ? strtoull(p, &end, 10) : 0;
    if (end != NULL && errno == 0) {
      *out = (uint64_t)v;
      found = true;
    }
  }
  fclose(f);
  return found;
}

/* Fill the model's request pool; false (after saying why) if its sizes are unusable. */
static bool make_pool(model_t *md, const config *c, uint64_t *rng) {
  const char *kind_name = serve_model_kind(md->m);
  uint64_t cap = c->max_seq, limit = 0;
  if (strcmp(kind_name, "mlp") == 0) md->k = KIND_MLP;
  else if (strcmp(kind_name, "lstm") == 0) md->k = KIND_LSTM;
  else if (strcmp(kind_name, "seq2seq") == 0) md->k = KIND_SEQ2SEQ;
  else if (strcmp(kind_name, "treelstm") == 0) md->k = KIND_TREE;
  else {
    fprintf(stderr, "soak: %s: unknown model kind \"%s\"\n", md->dir, kind_name);
    return false;
  }
  md->in_len = serve_model_input_len(md->m);
  md->out_len = serve_model_output_len(md->m);
  if (md->k == KIND_MLP) {
    if (md->in_len == 0 || md->in_len > (1u << 22) || md->out_len == 0) {
      fprintf(stderr, "soak: %s: mlp with input %zu, output %zu\n", md->dir, md->in_len,
              md->out_len);
      return false;
    }
    md->f32 = malloc(sizeof(float) * POOL * md->in_len);
    if (md->f32 == NULL) return false;
    for (size_t i = 0; i < POOL * md->in_len; i++) md->f32[i] = (float)(rng_unit(rng) * 4 - 2);
    for (size_t i = 0; i < POOL; i++) md->lens[i] = md->in_len;
    return true;
  }
  if (!toml_int(md->dir, "vocab", &md->vocab) || md->vocab == 0 || md->vocab > UINT32_MAX) {
    fprintf(stderr, "soak: %s/model.toml: no usable `vocab` (1 to 2^32-1)\n", md->dir);
    return false;
  }
  if (md->k == KIND_SEQ2SEQ && (!toml_int(md->dir, "max_decode", &md->max_decode) ||
                                md->max_decode == 0)) {
    fprintf(stderr, "soak: %s/model.toml: no usable `max_decode`\n", md->dir);
    return false;
  }
  if (toml_int(md->dir, md->k == KIND_TREE ? "max_nodes" : "max_len", &limit) && limit > 0 &&
      limit < cap)
    cap = limit;
  if (md->k != KIND_SEQ2SEQ && md->out_len == 0) {
    fprintf(stderr, "soak: %s: %s with output length 0\n", md->dir, kind_name);
    return false;
  }
  md->stride = (size_t)cap;
  md->tokens = malloc(sizeof(uint32_t) * POOL * md->stride);
  md->parents = malloc(sizeof(int32_t) * POOL * md->stride);
  if (md->tokens == NULL || md->parents == NULL) return false;
  for (size_t i = 0; i < POOL; i++) {
    size_t n = 1 + (size_t)rng_below(rng, cap);
    md->lens[i] = n;
    for (size_t j = 0; j < n; j++) {
      md->tokens[i * md->stride + j] = (uint32_t)rng_below(rng, md->vocab);
      /* A random tree: node 0 is the root, every other node hangs under an earlier one. */
      md->parents[i * md->stride + j] = j == 0 ? -1 : (int32_t)rng_below(rng, j);
    }
  }
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * Exactly-once ledger
 *
 * Request `seq` (its attempt number) has tag (seq << 4) | model and lives in slot seq & mask:
 * `tag1` = tag + 1 while it is outstanding, 0 when free; `id1` = request id + 1, written by
 * whichever of the submitter (after submit returns) and the consumer (on completion) comes
 * second compares it with the other's. The submitter marks a slot before submitting (a
 * completion can arrive before submit returns) and clears it if the submit is refused; a slot
 * still taken when its turn comes round (the client holding more than `mask + 1` requests) is
 * skipped and counted, not submitted.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
  _Atomic uint64_t tag1, id1;
} slot_t;

typedef struct {
  config cfg;
  serve_runtime *rt;
  serve_queue *q;
  model_t models[MAX_MODELS];
  size_t n_models;
  slot_t *slots;
  uint64_t mask;
  uint64_t next_seq; /* submitter only */
  atomic_uint_fast64_t accepted, completed, ledger_full, violations, bad_outputs;
  atomic_uint_fast64_t by_code[CODES], refused_by_code[CODES];
  atomic_bool window_mode, finish, paused;
  sem_t credits;                  /* closed loop: free window places */
  sem_t primed, go;               /* submitter -> main: priming done; main -> submitter: run */
  bool prime_ok;                  /* set by the submitter before posting `primed` */
  uint64_t burst;                 /* requests accepted in the priming's overload burst */
  uint64_t soak_start, soak_end;  /* open loop: [start, end) */
  double rate;                    /* open loop: arrivals/s */
  uint64_t max_lag_ns;            /* open loop: how far the submitter fell behind its schedule */
  atomic_uint_fast64_t backlog_peak; /* most accepted and unsettled at a submit, this sample */
} soak_t;

static unsigned code_index(serve_code code) { return (unsigned)code < CODES ? (unsigned)code : CODES - 1; }

/* Submit pool request `pick` of model `mi`; true if accepted. */
static bool submit_one(soak_t *s, size_t mi, size_t pick) {
  model_t *md = &s->models[mi];
  uint64_t seq = s->next_seq++, tag = (seq << 4) | mi, id = 0;
  slot_t *slot = &s->slots[seq & s->mask];
  if (atomic_load_explicit(&slot->tag1, memory_order_acquire) != 0) {
    atomic_fetch_add(&s->ledger_full, 1);
    return false;
  }
  atomic_store_explicit(&slot->id1, 0, memory_order_relaxed);
  atomic_store_explicit(&slot->tag1, tag + 1, memory_order_release);
  size_t n = md->lens[pick];
  serve_error *err;
  switch (md->k) {
  case KIND_MLP:
    err = serve_submit_f32(md->m, s->q, tag, md->f32 + pick * md->in_len, n, NULL, &id);
    break;
  case KIND_TREE:
    err = serve_submit_tree(md->m, s->q, tag, md->tokens + pick * md->stride,
                            md->parents + pick * md->stride, n, NULL, &id);
    break;
  default:
    err = serve_submit_tokens(md->m, s->q, tag, md->tokens + pick * md->stride, n, NULL, &id);
    break;
  }
  if (err != NULL) {
    serve_code code = serve_error_code(err);
    atomic_store_explicit(&slot->tag1, 0, memory_order_release);
    if (atomic_fetch_add(&s->refused_by_code[code_index(code)], 1) == 0 && code != SERVE_CODE_BUSY)
      fail("submit to %s refused: %s: %s", md->dir, serve_code_name((uint32_t)code),
           serve_error_message(err));
    serve_error_free(err);
    return false;
  }
  uint64_t backlog = atomic_fetch_add(&s->accepted, 1) + 1 - atomic_load(&s->completed);
  if (backlog > atomic_load_explicit(&s->backlog_peak, memory_order_relaxed))
    atomic_store_explicit(&s->backlog_peak, backlog, memory_order_relaxed);
  uint64_t other = atomic_exchange(&slot->id1, id + 1);
  if (other != 0 && other != id + 1) {
    atomic_fetch_add(&s->violations, 1);
    fail("tag %" PRIu64 ": submit returned id %" PRIu64 ", its completion carried %" PRIu64, tag,
         id, other - 1);
  }
  return true;
}

static void check_output(soak_t *s, const model_t *md, const serve_completion *c) {
  bool good = true;
  if (md->k == KIND_SEQ2SEQ) {
    const uint32_t *t = NULL;
    size_t n = 0;
    good = ok(serve_completion_output_tokens(c, &t, &n), "serve_completion_output_tokens") &&
           n >= 1 && n <= md->max_decode;
    for (size_t i = 0; good && i < n; i++) good = t[i] < md->vocab;
  } else {
    const float *v = NULL;
    size_t n = 0;
    good = ok(serve_completion_output_f32(c, &v, &n), "serve_completion_output_f32") &&
           n == md->out_len;
    for (size_t i = 0; good && i < n; i++) good = isfinite(v[i]);
  }
  if (!good && atomic_fetch_add(&s->bad_outputs, 1) == 0)
    fail("%s: an OK output of the wrong length, a non-finite value or a token outside the "
         "vocabulary (tag %" PRIu64 ")",
         md->dir, serve_completion_tag(c));
}

/* Settle one completion against the ledger; counts it and frees it. */
static void settle(soak_t *s, serve_completion *c) {
  uint64_t tag = serve_completion_tag(c), id = serve_completion_request_id(c);
  serve_code code = serve_completion_code(c);
  size_t mi = (size_t)(tag & 15);
  slot_t *slot = &s->slots[(tag >> 4) & s->mask];
  uint64_t want = tag + 1;
  if (mi >= s->n_models || atomic_load_explicit(&slot->tag1, memory_order_acquire) != want) {
    atomic_fetch_add(&s->violations, 1);
    fail("completion with tag %" PRIu64 " (id %" PRIu64 ", %s) is not outstanding: a duplicate "
         "or unknown",
         tag, id, serve_code_name((uint32_t)code));
    serve_completion_free(c);
    return;
  }
  uint64_t other = atomic_exchange(&slot->id1, id + 1);
  if (other != 0 && other != id + 1) {
    atomic_fetch_add(&s->violations, 1);
    fail("tag %" PRIu64 ": completed with id %" PRIu64 ", submit returned %" PRIu64, tag, id,
         other - 1);
  }
  if (!atomic_compare_exchange_strong(&slot->tag1, &want, 0)) {
    atomic_fetch_add(&s->violations, 1);
    fail("tag %" PRIu64 " completed twice at once", tag);
  }
  if (atomic_fetch_add(&s->by_code[code_index(code)], 1) == 0 && code != SERVE_CODE_OK) {
    const char *msg = serve_completion_message(c);
    fail("a request to %s completed %s: %s", s->models[mi].dir, serve_code_name((uint32_t)code),
         msg ? msg : "");
  }
  if (code == SERVE_CODE_OK) check_output(s, &s->models[mi], c);
  /* Counted settled before the free releases its admission place: otherwise a submit accepted in
   * between reads a backlog one over the bounds' sum that the runtime never held. */
  atomic_fetch_add(&s->completed, 1);
  serve_completion_free(c);
  if (atomic_load(&s->window_mode)) sem_post(&s->credits);
}

static void *consumer(void *arg) {
  soak_t *s = arg;
  serve_completion *batch[DRAIN_BATCH];
  for (;;) {
    size_t n = 0;
    if (atomic_load(&s->paused) && !atomic_load(&s->finish)) {
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (!ok(serve_queue_next(s->q, batch, DRAIN_BATCH, 50000000u, &n), "serve_queue_next")) break;
    for (size_t i = 0; i < n; i++) settle(s, batch[i]);
    if (n == 0 && atomic_load(&s->finish)) break;
  }
  return NULL;
}

static uint64_t outstanding(soak_t *s) {
  return atomic_load(&s->accepted) - atomic_load(&s->completed);
}

/* Wait up to `limit_ns` for every accepted request to be settled. */
static bool wait_settled(soak_t *s, uint64_t limit_ns) {
  uint64_t until = now_ns() + limit_ns;
  while (outstanding(s) != 0) {
    if (now_ns() > until) return false;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * Calibration (closed loop) and the soak (open loop)
 * ------------------------------------------------------------------------------------------- */

static bool calibrate(soak_t *s, size_t mi, uint64_t *rng) {
  model_t *md = &s->models[mi];
  uint64_t t0 = now_ns(), len = (uint64_t)(s->cfg.calibrate_seconds * NS_PER_S);
  uint64_t t_measure = t0 + len / 5, t_end = t0 + len, c0 = 0, m0 = 0;
  bool measuring = false;
  if (sem_init(&s->credits, 0, (unsigned)s->cfg.window) != 0) return false;
  atomic_store(&s->window_mode, true);
  for (;;) {
    uint64_t t = now_ns();
    if (t >= t_end) break;
    if (!measuring && t >= t_measure) {
      measuring = true;
      m0 = t;
      c0 = atomic_load(&s->completed);
    }
    struct timespec deadline = {0, 0};
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += 10000000; /* wake at least every 10 ms to watch the clock */
    if (deadline.tv_nsec >= 1000000000) deadline.tv_sec++, deadline.tv_nsec -= 1000000000;
    if (sem_timedwait(&s->credits, &deadline) != 0) continue;
    if (!submit_one(s, mi, (size_t)rng_below(rng, POOL))) sem_post(&s->credits);
  }
  uint64_t c1 = atomic_load(&s->completed), m1 = now_ns();
  bool settled = wait_settled(s, DRAIN_TIMEOUT_NS);
  atomic_store(&s->window_mode, false);
  sem_destroy(&s->credits);
  if (!settled) {
    fail("calibrating %s: requests still outstanding after 60 s", md->dir);
    return false;
  }
  md->capacity = measuring && m1 > m0 ? (double)(c1 - c0) * NS_PER_S / (double)(m1 - m0) : 0;
  printf("calibrate %s (%s): %.0f completions/s with %" PRIu64 " outstanding\n", md->dir,
         serve_model_kind(md->m), md->capacity, s->cfg.window);
  if (md->capacity <= 0) fail("calibrating %s: no completions measured", md->dir);
  return md->capacity > 0;
}

/* Take the runtime through the worst its bounds allow before the RSS baseline (see the top of
 * the file): fill every model to its admission bound at once with the consumer paused, wait
 * until the runtime has completed all of it (the completions then wait in the queue) and let the
 * consumer settle it; then, consumer running, submit to the models in turns as fast as this
 * thread can for --prime-seconds. Refusals here are the bounds doing their job and are not
 * counted. Returns the requests accepted in the burst. */
static bool prime(soak_t *s, uint64_t *rng, uint64_t *burst) {
  atomic_store(&s->paused, true);
  bool open[MAX_MODELS];
  size_t n_open = s->n_models;
  for (size_t mi = 0; mi < s->n_models; mi++) open[mi] = true;
  for (size_t mi = 0; n_open > 0; mi = (mi + 1) % s->n_models)
    if (open[mi] && !submit_one(s, mi, (size_t)rng_below(rng, POOL))) open[mi] = false, n_open--;
  uint64_t until = now_ns() + DRAIN_TIMEOUT_NS;
  bool done = false;
  while (!done && now_ns() < until) {
    serve_stats *st = NULL;
    if (!ok(serve_runtime_stats(s->rt, &st), "serve_runtime_stats")) break;
    done = serve_stats_in_flight(st) == 0;
    serve_stats_free(st);
    struct timespec ts = {0, 1000000};
    if (!done) nanosleep(&ts, NULL);
  }
  atomic_store(&s->paused, false);
  bool settled = wait_settled(s, DRAIN_TIMEOUT_NS);
  uint64_t from = atomic_load(&s->accepted);
  uint64_t end = now_ns() + (uint64_t)(s->cfg.prime_seconds * NS_PER_S);
  for (size_t mi = 0; settled && done && now_ns() < end; mi = (mi + 1) % s->n_models)
    submit_one(s, mi, (size_t)rng_below(rng, POOL));
  *burst = atomic_load(&s->accepted) - from;
  settled = settled && wait_settled(s, DRAIN_TIMEOUT_NS);
  for (unsigned i = 0; i < CODES; i++) atomic_store(&s->refused_by_code[i], 0);
  atomic_store(&s->ledger_full, 0);
  if (!done || !settled) fail("priming: requests still outstanding after 60 s");
  return done && settled;
}

/* The one thread that submits from priming on: glibc gives each allocating thread its own
 * arena, and the runtime copies a request's input on the caller's thread, so the arena that
 * holds the requests in flight is this thread's; priming from another thread would leave it to
 * reach its high during the run. Primes, tells main, waits for the go, then offers the open loop. */
static void *submitter(void *arg) {
  soak_t *s = arg;
  uint64_t rng = s->cfg.seed * 0x9E3779B97F4A7C15ull | 1;
  s->prime_ok = prime(s, &rng, &s->burst);
  sem_post(&s->primed);
  while (sem_wait(&s->go) != 0) {
  }
  if (!s->prime_ok) return NULL; /* main set the run's schedule only if priming succeeded */
  double next = (double)s->soak_start, step = NS_PER_S / s->rate;
  for (;;) {
    next += -log1p(-rng_unit(&rng)) * step; /* exponential inter-arrival times */
    if (next >= (double)s->soak_end) break;
    uint64_t t = now_ns(), at = (uint64_t)next;
    if (at > t) sleep_until_ns(at);
    else if (t - at > s->max_lag_ns) s->max_lag_ns = t - at;
    size_t mi = (size_t)rng_below(&rng, s->n_models);
    submit_one(s, mi, (size_t)rng_below(&rng, POOL));
  }
  return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Setup, the run, teardown
 * ------------------------------------------------------------------------------------------- */

static bool setup(soak_t *s, uint64_t *rng) {
  const config *c = &s->cfg;
  serve_runtime_options *ro = NULL;
  if (!ok(serve_runtime_options_new(&ro), "serve_runtime_options_new")) return false;
  bool good = ok(serve_runtime_options_set_backend(ro, c->backend), "--backend") &&
              ok(serve_runtime_options_set_cpu_threads(ro, (uint32_t)c->cpu_threads),
                 "--cpu-threads") &&
              ok(serve_runtime_options_set_admission_bound(ro, c->admission_bound),
                 "--admission-bound") &&
              ok(serve_runtime_new(ro, &s->rt), "serve_runtime_new");
  serve_runtime_options_free(ro);
  if (!good || !ok(serve_queue_new(&s->q), "serve_queue_new")) return false;
  for (size_t i = 0; i < c->n_models; i++) {
    model_t *md = &s->models[i];
    md->dir = c->models[i];
    char what[4200];
    snprintf(what, sizeof what, "loading %s", md->dir);
    if (!ok(serve_runtime_load_model(s->rt, md->dir, NULL, &md->m), what)) return false;
    s->n_models++;
    if (!make_pool(md, c, rng)) return false;
  }
  /* Ledger: a power of two at least 8× every admission bound together (at least 2^16). */
  uint64_t want = 8 * c->admission_bound * s->n_models, n = 1u << 16;
  while (n < want) n <<= 1;
  s->mask = n - 1;
  s->slots = calloc((size_t)n, sizeof(slot_t));
  if (s->slots == NULL) {
    fprintf(stderr, "soak: cannot allocate a ledger of %" PRIu64 " slots\n", n);
    return false;
  }
  memset(s->slots, 0, (size_t)n * sizeof(slot_t)); /* touch it now: not growth later */
  printf("soak: libserve %s, backend %s, %zu model(s), ledger %" PRIu64 " slots\n",
         serve_version(), serve_runtime_backend(s->rt), s->n_models, n);
  return true;
}

/* Shut down with drain, settle everything, and check that nothing is pending. */
static void teardown_checks(soak_t *s, pthread_t cons) {
  ok(serve_runtime_shutdown(s->rt, DRAIN_TIMEOUT_NS), "serve_runtime_shutdown (drain)");
  bool settled = wait_settled(s, DRAIN_TIMEOUT_NS);
  atomic_store(&s->finish, true);
  pthread_join(cons, NULL);
  if (!settled)
    fail("after shutdown with drain: %" PRIu64 " accepted request(s) never completed (lost)",
         outstanding(s));
  serve_completion *late[8];
  size_t n = 0;
  if (ok(serve_queue_next(s->q, late, 8, 100000000u, &n), "serve_queue_next (after drain)")) {
    for (size_t i = 0; i < n; i++) settle(s, late[i]); /* each one is a duplicate or unknown */
  }
  for (uint64_t i = 0; i <= s->mask; i++)
    if (atomic_load(&s->slots[i].tag1) != 0) {
      fail("ledger: tag %" PRIu64 " still outstanding after the drain",
           atomic_load(&s->slots[i].tag1) - 1);
      break;
    }
  serve_stats *st = NULL;
  if (ok(serve_runtime_stats(s->rt, &st), "serve_runtime_stats")) {
    uint64_t sub = serve_stats_submitted(st), total = serve_stats_completed_total(st);
    if (sub != atomic_load(&s->accepted) || total != sub ||
        serve_stats_completed(st, SERVE_CODE_OK) != atomic_load(&s->by_code[SERVE_CODE_OK]) ||
        serve_stats_in_flight(st) != 0 || serve_stats_queued(st) != 0 ||
        serve_stats_running(st) != 0)
      fail("stats after drain: submitted %" PRIu64 " (client accepted %" PRIu64
           "), completed %" PRIu64 ", OK %" PRIu64 " (client %" PRIu64 "), in flight %" PRIu64
           ", queued %" PRIu64 ", running %" PRIu64,
           sub, (uint64_t)atomic_load(&s->accepted), total,
           serve_stats_completed(st, SERVE_CODE_OK), (uint64_t)atomic_load(&s->by_code[0]),
           serve_stats_in_flight(st), serve_stats_queued(st), serve_stats_running(st));
    serve_stats_free(st);
  }
}

static void free_all(soak_t *s) {
  for (size_t i = 0; i < s->n_models; i++) {
    serve_model_free(s->models[i].m);
    free(s->models[i].f32);
    free(s->models[i].tokens);
    free(s->models[i].parents);
  }
  serve_queue_free(s->q);
  serve_runtime_free(s->rt);
  free(s->slots);
}

/* One `sample` line; returns the interval's backlog peak. */
static uint64_t print_sample(soak_t *s, uint64_t t, uint64_t *last_t, uint64_t *last_done) {
  uint64_t done = atomic_load(&s->completed), rejected = 0;
  uint64_t backlog = atomic_exchange(&s->backlog_peak, 0);
  for (unsigned i = 0; i < CODES; i++) rejected += atomic_load(&s->refused_by_code[i]);
  heap_t heap = heap_bytes();
  double dt = (double)(t - *last_t) / NS_PER_S;
  printf("sample t=%.1fs submitted=%" PRIu64 " completed=%" PRIu64 " rejected=%" PRIu64
         " rate=%.0f/s backlog_max=%" PRIu64 " rss=%.2fMiB heap=%.2fMiB held=%.2fMiB\n",
         (double)(t - s->soak_start) / NS_PER_S, (uint64_t)atomic_load(&s->accepted), done,
         rejected + (uint64_t)atomic_load(&s->ledger_full),
         dt > 0 ? (double)(done - *last_done) / dt : 0.0, backlog, mib(rss_bytes()),
         mib(heap.in_use), mib(heap.held));
  *last_t = t;
  *last_done = done;
  return backlog;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  static soak_t s; /* large (counters, models); zero-initialized */
  static mem_map_t map_warm, map_end; /* where RSS changed after warm-up (soak_mem.h) */
  mem_touch(&map_warm);
  mem_touch(&map_end);
  mem_snapshot(&map_end); /* and its code, run once before the baseline */
  if (!parse_args(argc, argv, &s.cfg)) {
    usage(argv[0]);
    return 2;
  }
  uint64_t rng = s.cfg.seed;
  pthread_t cons, sub;
  if (!setup(&s, &rng)) {
    free_all(&s);
    return 2;
  }
  if (pthread_create(&cons, NULL, consumer, &s) != 0) {
    fprintf(stderr, "soak: cannot start the consumer thread\n");
    free_all(&s);
    return 2;
  }

  /* Capacity: each model alone, closed loop; the equal mix's capacity is harmonic. */
  double inv = 0;
  bool calibrated = true;
  for (size_t i = 0; calibrated && i < s.n_models; i++) {
    calibrated = calibrate(&s, i, &rng);
    if (calibrated) inv += 1.0 / s.models[i].capacity;
  }
  double capacity = calibrated ? (double)s.n_models / inv : 0;
  bool started = false;
  if (calibrated) {
    uint64_t primed_from = atomic_load(&s.accepted);
    started = sem_init(&s.primed, 0, 0) == 0 && sem_init(&s.go, 0, 0) == 0 &&
              pthread_create(&sub, NULL, submitter, &s) == 0;
    if (!started) fail("cannot start the submitter thread");
    else
      while (sem_wait(&s.primed) != 0) {
      }
    calibrated = started && s.prime_ok;
    if (calibrated)
      printf("primed: %" PRIu64 " requests held to the admission bounds, then drained; an "
             "overload burst of %" PRIu64 " requests in %.0f s; rss=%.2fMiB heap=%.2fMiB\n",
             (uint64_t)atomic_load(&s.accepted) - primed_from - s.burst, s.burst,
             s.cfg.prime_seconds, mib(rss_bytes()), mib(heap_bytes().in_use));
  }
  uint64_t rss_warm = 0, rss_end = 0, rss_max = 0, before = 0, backlog_before = 0, backlog_after = 0;
  uint64_t heap_warm = 0, heap_end = 0;
  uint64_t accepted_before = atomic_load(&s.accepted), completed_before = atomic_load(&s.completed);
  if (calibrated) {
    s.rate = s.cfg.load * capacity;
    printf("soak: capacity %.0f/s (mix of %zu), offering %.0f/s (load %.2f) for %.0f s; warm-up "
           "%.0f s, samples every %.0f s, RSS growth limit %.2f%%\n",
           capacity, s.n_models, s.rate, s.cfg.load, s.cfg.seconds, s.cfg.warmup_seconds,
           s.cfg.sample_seconds, s.cfg.max_growth);
    before = rss_bytes();
    atomic_store(&s.backlog_peak, 0); /* calibration's window does not count */
    s.soak_start = now_ns() + 1000000;
    s.soak_end = s.soak_start + (uint64_t)(s.cfg.seconds * NS_PER_S);
  }
  if (started) sem_post(&s.go); /* run, or return if priming failed */
  if (calibrated) {
    uint64_t warm_at = s.soak_start + (uint64_t)(s.cfg.warmup_seconds * NS_PER_S);
    uint64_t period = (uint64_t)(s.cfg.sample_seconds * NS_PER_S), next = s.soak_start + period;
    uint64_t last_t = s.soak_start, last_done = atomic_load(&s.completed);
    bool warmed = false;
    for (;;) {
      uint64_t at = next < s.soak_end ? next : s.soak_end;
      if (!warmed && warm_at <= at) at = warm_at;
      sleep_until_ns(at);
      if (at == s.soak_end) break;
      if (at == next) { /* a sample (before the warm-up mark if both fall here) */
        uint64_t b = print_sample(&s, at, &last_t, &last_done), r = rss_bytes();
        uint64_t *peak = warmed ? &backlog_after : &backlog_before;
        if (b > *peak) *peak = b;
        if (warmed && r > rss_max) rss_max = r;
        next += period;
      }
      if (!warmed && at == warm_at) {
        warmed = true;
        uint64_t b = atomic_exchange(&s.backlog_peak, 0);
        if (b > backlog_before) backlog_before = b;
        rss_warm = rss_max = rss_bytes();
        heap_warm = heap_bytes().in_use;
        mem_snapshot(&map_warm);
        printf("warm-up done at t=%.1fs: rss=%.2fMiB heap=%.2fMiB (before the run %.2fMiB)\n",
               (double)(at - s.soak_start) / NS_PER_S, mib(rss_warm), mib(heap_warm), mib(before));
      }
    }
    /* The end's figures before the submitter is joined: its exit runs C library code the run
     * never did (64 KiB of libc's text faulted in), which is not growth of the runtime's. */
    rss_end = rss_bytes();
    heap_end = heap_bytes().in_use;
    mem_snapshot(&map_end);
    pthread_join(sub, NULL);
    started = false;
    if (rss_end > rss_max) rss_max = rss_end;
    uint64_t b = print_sample(&s, now_ns(), &last_t, &last_done);
    if (b > backlog_after) backlog_after = b;
  }
  if (started) pthread_join(sub, NULL);

  teardown_checks(&s, cons);

  double growth = rss_warm ? 100.0 * ((double)rss_end - (double)rss_warm) / (double)rss_warm : 0;
  uint64_t acc = atomic_load(&s.accepted) - accepted_before;
  uint64_t rejected = 0;
  for (unsigned i = 0; i < CODES; i++) rejected += atomic_load(&s.refused_by_code[i]);
  printf("soak summary: capacity %.0f/s, offered %.0f/s, achieved %.0f/s accepted (%" PRIu64
         " in %.0f s), %" PRIu64 " refused (BUSY %" PRIu64 "), %" PRIu64
         " skipped (ledger full), submitter lag max %.1f ms, backlog peak %" PRIu64
         " in warm-up, %" PRIu64 " after; completions:",
         capacity, s.rate, calibrated ? (double)acc / s.cfg.seconds : 0.0, acc, s.cfg.seconds,
         rejected, (uint64_t)atomic_load(&s.refused_by_code[SERVE_CODE_BUSY]),
         (uint64_t)atomic_load(&s.ledger_full), (double)s.max_lag_ns / 1e6, backlog_before,
         backlog_after);
  for (unsigned i = 0; i < CODES; i++)
    if (atomic_load(&s.by_code[i]) != 0)
      printf(" %s %" PRIu64, serve_code_name(i), (uint64_t)atomic_load(&s.by_code[i]));
  printf(" (soak %" PRIu64 " of them, calibration %" PRIu64 "); rss warm-up %.2f MiB, end %.2f "
         "MiB, max %.2f MiB, growth %.3f%% (limit %.2f%%); heap in use warm-up %.2f MiB, end "
         "%.2f MiB; ledger violations %" PRIu64 ", bad outputs %" PRIu64 "\n",
         (uint64_t)atomic_load(&s.completed) - completed_before, completed_before, mib(rss_warm),
         mib(rss_end), mib(rss_max), growth, s.cfg.max_growth, mib(heap_warm), mib(heap_end),
         (uint64_t)atomic_load(&s.violations), (uint64_t)atomic_load(&s.bad_outputs));
  if (rss_warm != 0) mem_print_changes(&map_warm, &map_end, 12);
  if (calibrated && growth > s.cfg.max_growth)
    fail("RSS grew %.3f%% from warm-up to the end, over the %.2f%% limit", growth,
         s.cfg.max_growth);
  free_all(&s);

  if (atomic_load(&g_failures) != 0) {
    printf("soak: FAILED (%d check(s))\n", atomic_load(&g_failures));
    return 1;
  }
  printf("soak: ok\n");
  return 0;
}
