/*
 * tenants.c: several layer models sharing the CPU cores under libserve's tenant scheduler
 * (VELTAIR; ARCHITECTURE.md §7.9, serve_runtime_add_tenants). Built and run by
 * tests/custom_native.rs (under AddressSanitizer + UBSan with SERVE_C_SANITIZE=1).
 *
 * The group: an mlp loaded from a directory (argv[1]) and two custom C engines of three layers
 * each (layer 0: s = Σ_i x[i]·(i+1); layer 1: t = 2s; layer 2: y[j] = scale·t + j), one with a
 * QoS target it meets and one with a target of 1 ns that nothing meets (flagged, served anyway).
 * The scheme is layer-wise, so every block is one layer. Checks: bad groups are refused
 * precisely; every request completes exactly once with the right output (the mlp's against the
 * same directory served as a plain model); every engine call has a core lease of `cores` CPUs,
 * runs pinned to its first CPU, and no CPU is leased to two calls at once; the user data is
 * freed exactly once.
 *
 * Usage: tenants MLP_DIR
 */
#define _GNU_SOURCE /* sched_getcpu */
#include "libserve.h"

#include <math.h>
#include <sched.h>
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
#define PER_MODEL 150
#define MS 1000000ull

/* CPUs leased to a running call, one bit each (CPUs 0..63; the test machine's). */
static atomic_ullong g_busy;
static atomic_int g_overlaps, g_bad_leases, g_unpinned, g_whole_calls;

typedef struct engine {
  float scale;
  atomic_int calls;
  atomic_int freed;
} engine;

static float row_sum(const float *x) {
  float s = 0.0f;
  for (int i = 0; i < IN; i++) s += x[i] * (float)(i + 1);
  return s;
}

/* Take the call's CPUs; false if one was already taken (a lease given twice). */
static bool take(const serve_custom_call *call) {
  bool alone = true;
  for (size_t i = 0; i < call->cpu_count; i++) {
    if (call->cpus[i] >= 64) continue;
    unsigned long long bit = 1ull << call->cpus[i];
    if (atomic_fetch_or(&g_busy, bit) & bit) alone = false;
  }
  return alone;
}

static void give_back(const serve_custom_call *call, bool took) {
  if (!took) return; /* the bits belong to the other call */
  for (size_t i = 0; i < call->cpu_count; i++) {
    if (call->cpus[i] < 64) atomic_fetch_and(&g_busy, ~(1ull << call->cpus[i]));
  }
}

static int32_t execute(void *user_data, const serve_custom_call *call) {
  engine *e = user_data;
  atomic_fetch_add(&e->calls, 1);
  if (call->cpu_count == 0 || call->cpus == NULL || call->cpu_count != call->cores) {
    atomic_fetch_add(&g_bad_leases, 1);
    return 1;
  }
#ifdef __linux__
  if ((size_t)sched_getcpu() != call->cpus[0]) atomic_fetch_add(&g_unpinned, 1);
#endif
  bool took = take(call);
  if (!took) atomic_fetch_add(&g_overlaps, 1);
  if (call->last_layer - call->first_layer != 1) atomic_fetch_add(&g_whole_calls, 1);
  for (size_t r = 0; r < call->batch; r++) {
    const float *x = call->input + r * call->input_stride;
    float *y = call->output + r * call->output_stride;
    float v = x[0];
    for (size_t l = call->first_layer; l < call->last_layer; l++) {
      if (l == 0) v = row_sum(x);
      if (l == 1) v = 2.0f * v;
    }
    if (call->last_layer == 3) {
      for (int j = 0; j < OUT; j++) y[j] = e->scale * v + (float)j;
    } else {
      y[0] = v;
    }
  }
  give_back(call, took);
  return 0;
}

static void free_engine(void *user_data) {
  engine *e = user_data;
  atomic_fetch_add(&e->freed, 1);
}

/* A custom engine's options: three layers (or none). */
static serve_custom_model_options *engine_options(engine *e, bool layers) {
  serve_custom_model_options *co = NULL;
  if (!ok(serve_custom_model_options_new(IN, OUT, execute, e, free_engine, &co), "custom options"))
    return NULL;
  if (layers && !(ok(serve_custom_model_options_add_layer(co, "sum", 4 * IN, 2 * IN, 1), "layer 0") &&
                  ok(serve_custom_model_options_add_layer(co, "double", 0, 1, 1), "layer 1") &&
                  ok(serve_custom_model_options_add_layer(co, "affine", 4, 2 * OUT, OUT), "layer 2"))) {
    serve_custom_model_options_free(co);
    return NULL;
  }
  return co;
}

static void input(int k, float *x, size_t len) {
  for (size_t i = 0; i < len; i++) x[i] = (float)((k * 7 + (int)i * 3) % 11) * 0.25f - 1.0f;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: tenants MLP_DIR\n");
    return 2;
  }
  const char *mlp_dir = argv[1];
  serve_runtime_options *ro = NULL;
  serve_runtime *rt = NULL;
  if (!ok(serve_runtime_options_new(&ro), "runtime options") ||
      !ok(serve_runtime_options_set_backend(ro, "cpu"), "backend") ||
      !ok(serve_runtime_new(ro, &rt), "runtime")) {
    return 1;
  }
  serve_runtime_options_free(ro);

  /* The mlp served plainly: the reference for its tenant's outputs, and a model that is not a
   * tenant. */
  serve_model *plain = NULL;
  if (!ok(serve_runtime_load_model(rt, mlp_dir, NULL, &plain), "load the mlp")) return 1;
  const size_t mlp_in = serve_model_input_len(plain), mlp_out = serve_model_output_len(plain);
  bool feasible = true;
  expect_error(serve_model_tenant_feasible(plain, &feasible), SERVE_CODE_INVALID_ARGUMENT,
               "not a tenant", "feasible of a plain model");

  engine a = {.scale = 0.5f}, b = {.scale = -1.5f}, flat = {.scale = 1.0f};
  serve_custom_model_options *ca = engine_options(&a, true), *cb = engine_options(&b, true),
                             *cf = engine_options(&flat, false);
  if (ca == NULL || cb == NULL || cf == NULL) return 1;

  /* Bad groups and settings: each refused precisely. */
  serve_tenants *t = NULL;
  if (!ok(serve_tenants_new(&t), "tenants")) return 1;
  expect_error(serve_tenants_set_scheme(t, "fastest"), SERVE_CODE_INVALID_ARGUMENT,
               "unknown tenant policy `fastest`", "unknown scheme");
  expect_error(serve_tenants_set_levels(t, 0, 0.25), SERVE_CODE_INVALID_ARGUMENT,
               "0 interference levels", "no levels");
  expect_error(serve_tenants_set_levels(t, 5, NAN), SERVE_CODE_INVALID_ARGUMENT,
               "a level step of NaN", "NaN level step");
  expect_error(serve_tenants_add_model(t, "/nonexistent/model", NULL, 100 * MS), SERVE_CODE_NOT_FOUND,
               "/nonexistent/model", "missing directory");
  expect_error(serve_tenants_add_custom_model(t, ca, "a", 0), SERVE_CODE_INVALID_ARGUMENT,
               "QoS target of 0ns", "QoS 0");
  expect_error(serve_tenants_add_custom_model(t, ca, "a", 7200000 * MS), SERVE_CODE_INVALID_ARGUMENT,
               "at most 3600s", "QoS of two hours");
  CHECK(serve_tenants_len(t) == 0, "%zu tenants after refusals", serve_tenants_len(t));
  serve_model *slots[3] = {NULL, NULL, NULL};
  expect_error(serve_runtime_add_tenants(rt, t, slots, 0), SERVE_CODE_INVALID_ARGUMENT, "0 tenant models",
               "an empty group");
  if (!ok(serve_tenants_add_custom_model(t, cf, "flat", 50 * MS), "add flat")) return 1;
  expect_error(serve_runtime_add_tenants(rt, t, slots, 1), SERVE_CODE_INVALID_ARGUMENT,
               "the tenant mode serves layer models", "a model without layers");
  expect_error(serve_runtime_add_tenants(rt, t, slots, 2), SERVE_CODE_INVALID_ARGUMENT,
               "`models_len` is 2; the group has 1", "models_len");
  serve_tenants_free(t);
  serve_custom_model_options_free(cf);
  CHECK(slots[0] == NULL && slots[1] == NULL, "slots written by a failed call");
  CHECK(atomic_load(&flat.calls) == 0, "the refused model was called");

  if (!ok(serve_tenants_new(&t), "tenants") || !ok(serve_tenants_set_cores(t, 4096), "cores")) return 1;
  if (!ok(serve_tenants_add_custom_model(t, ca, "a", 50 * MS), "add a")) return 1;
  expect_error(serve_runtime_add_tenants(rt, t, slots, 1), SERVE_CODE_INVALID_ARGUMENT,
               "a pool of 4096 cores", "too many cores");
  serve_tenants_free(t);

  /* The group: layer-wise, every CPU, the mlp (100 ms), a (50 ms), b (1 ns: flagged). */
  if (!ok(serve_tenants_new(&t), "tenants") || !ok(serve_tenants_set_scheme(t, "layer-wise"), "scheme") ||
      !ok(serve_tenants_set_levels(t, 3, 0.5), "levels") ||
      !ok(serve_tenants_add_model(t, mlp_dir, "mlp", 100 * MS), "add the mlp") ||
      !ok(serve_tenants_add_custom_model(t, ca, "a", 50 * MS), "add a") ||
      !ok(serve_tenants_add_custom_model(t, cb, "b", 1), "add b")) {
    return 1;
  }
  serve_custom_model_options_free(ca);
  serve_custom_model_options_free(cb);
  CHECK(serve_tenants_len(t) == 3, "%zu tenants", serve_tenants_len(t));
  if (!ok(serve_runtime_add_tenants(rt, t, slots, 3), "add the tenants")) return 1;
  serve_tenants_free(t); /* the models keep serving */
  serve_model *mlp = slots[0], *ma = slots[1], *mb = slots[2];
  CHECK(strcmp(serve_model_kind(mlp), "mlp") == 0 && strcmp(serve_model_kind(ma), "custom") == 0,
        "kinds %s, %s", serve_model_kind(mlp), serve_model_kind(ma));
  bool fa = false, fb = true;
  uint64_t solo_a = 0;
  if (ok(serve_model_tenant_feasible(ma, &fa), "feasible a") &&
      ok(serve_model_tenant_feasible(mb, &fb), "feasible b") &&
      ok(serve_model_tenant_solo_ns(ma, &solo_a), "solo a")) {
    CHECK(fa, "a (50 ms for three tiny layers) flagged infeasible");
    CHECK(!fb, "b (1 ns) not flagged");
    CHECK(solo_a > 0 && solo_a < 50 * MS, "a's solo time %llu ns", (unsigned long long)solo_a);
  }
  int profiled = atomic_load(&a.calls);
  CHECK(profiled > 0, "a was not profiled");

  /* The mlp's reference outputs, from the plain model. */
  serve_queue *q = NULL;
  if (!ok(serve_queue_new(&q), "queue")) return 1;
  float *x = calloc(mlp_in > IN ? mlp_in : IN, sizeof(float));
  float *want = calloc((size_t)PER_MODEL * mlp_out, sizeof(float));
  if (x == NULL || want == NULL) return 1;
  for (int k = 0; k < PER_MODEL; k++) {
    input(k, x, mlp_in);
    if (!ok(serve_submit_f32(plain, q, (uint64_t)k, x, mlp_in, NULL, NULL), "submit plain")) return 1;
  }
  for (int done = 0; done < PER_MODEL;) {
    serve_completion *c = NULL;
    size_t n = 0;
    if (!ok(serve_queue_next(q, &c, 1, 10ull * 1000 * MS, &n), "plain next") || n == 0) return 1;
    const float *y = NULL;
    size_t len = 0;
    uint64_t tag = serve_completion_tag(c);
    CHECK(tag < PER_MODEL, "plain completion tag %llu", (unsigned long long)tag);
    if (tag < PER_MODEL && ok(serve_completion_output_f32(c, &y, &len), "plain output") && len == mlp_out) {
      memcpy(want + tag * mlp_out, y, mlp_out * sizeof(float));
    }
    serve_completion_free(c);
    done++;
  }

  /* Every tenant at once: tag = model · PER_MODEL + k. */
  serve_model *models[3] = {mlp, ma, mb};
  for (int k = 0; k < PER_MODEL; k++) {
    for (int m = 0; m < 3; m++) {
      size_t len = m == 0 ? mlp_in : IN;
      input(k, x, len);
      if (!ok(serve_submit_f32(models[m], q, (uint64_t)(m * PER_MODEL + k), x, len, NULL, NULL), "submit"))
        return 1;
    }
  }
  int seen[3 * PER_MODEL] = {0};
  for (int done = 0; done < 3 * PER_MODEL;) {
    serve_completion *cs[32];
    size_t n = 0;
    if (!ok(serve_queue_next(q, cs, 32, 10ull * 1000 * MS, &n), "next")) return 1;
    if (n == 0) {
      fail("no completion within 10 s (%d of %d done)", done, 3 * PER_MODEL);
      return 1;
    }
    for (size_t i = 0; i < n; i++) {
      uint64_t tag = serve_completion_tag(cs[i]);
      if (tag >= 3 * PER_MODEL) {
        fail("completion tag %llu was never submitted", (unsigned long long)tag);
        serve_completion_free(cs[i]);
        done++;
        continue;
      }
      int m = (int)(tag / PER_MODEL), k = (int)(tag % PER_MODEL);
      seen[tag]++;
      const float *y = NULL;
      size_t len = 0;
      if (ok(serve_completion_output_f32(cs[i], &y, &len), "tenant output")) {
        if (m == 0) {
          CHECK(len == mlp_out, "mlp request %d: %zu outputs", k, len);
          for (size_t j = 0; j < len && j < mlp_out; j++) {
            float w = want[(size_t)k * mlp_out + j];
            CHECK(fabsf(y[j] - w) <= 1e-4f * (1.0f + fabsf(w)), "mlp request %d output %zu: %g, want %g", k,
                  j, y[j], w);
          }
        } else {
          float xr[IN];
          input(k, xr, IN);
          const engine *e = m == 1 ? &a : &b;
          CHECK(len == OUT, "request %d of %s: %zu outputs", k, m == 1 ? "a" : "b", len);
          for (int j = 0; j < OUT && j < (int)len; j++) {
            float w = e->scale * 2.0f * row_sum(xr) + (float)j;
            CHECK(fabsf(y[j] - w) <= 1e-5f * (1.0f + fabsf(w)), "request %d of %s output %d: %g, want %g", k,
                  m == 1 ? "a" : "b", j, y[j], w);
          }
        }
      }
      serve_completion_free(cs[i]);
      done++;
    }
  }
  for (int i = 0; i < 3 * PER_MODEL; i++) CHECK(seen[i] == 1, "request %d completed %d times", i, seen[i]);
  int calls = atomic_load(&a.calls) - profiled;
  CHECK(calls >= 3 * PER_MODEL, "a served %d calls for %d queries of 3 layers", calls, PER_MODEL);
  CHECK(atomic_load(&g_bad_leases) == 0, "%d calls without their lease", atomic_load(&g_bad_leases));
  CHECK(atomic_load(&g_overlaps) == 0, "%d calls on a CPU leased to another", atomic_load(&g_overlaps));
  CHECK(atomic_load(&g_unpinned) == 0, "%d calls not on their lease's first CPU", atomic_load(&g_unpinned));
  /* Profiling runs one layer per call too, so every call was one layer under layer-wise. */
  CHECK(atomic_load(&g_whole_calls) == 0, "%d calls of several layers under layer-wise",
        atomic_load(&g_whole_calls));

  free(x);
  free(want);
  for (int m = 0; m < 3; m++) serve_model_free(models[m]);
  serve_model_free(plain);
  serve_queue_free(q);
  serve_runtime_free(rt);
  CHECK(atomic_load(&a.freed) == 1 && atomic_load(&b.freed) == 1 && atomic_load(&flat.freed) == 1,
        "user data freed %d, %d, %d times", atomic_load(&a.freed), atomic_load(&b.freed),
        atomic_load(&flat.freed));
  printf("tenants: a %d calls, b %d calls, a's solo time %llu ns\n", atomic_load(&a.calls),
         atomic_load(&b.calls), (unsigned long long)solo_a);
  if (atomic_load(&g_failures) != 0) {
    printf("tenants: %d check(s) FAILED\n", atomic_load(&g_failures));
    return 1;
  }
  printf("tenants: all checks passed\n");
  return 0;
}
