/*
 * soak_cli.h — the command line of soak.c (its options are documented at the top of soak.c).
 *
 * Included once, by soak.c, after its limits (MAX_MODELS) and the standard headers; every
 * function is static. Kept apart so that soak.c holds the run itself.
 */
#ifndef SOAK_CLI_H
#define SOAK_CLI_H

typedef struct {
  double seconds, load, max_growth, sample_seconds, warmup_seconds, calibrate_seconds,
      prime_seconds;
  uint64_t window, admission_bound, cpu_threads, max_seq, seed;
  const char *backend;
  const char *models[MAX_MODELS];
  size_t n_models;
} config;

static void usage(const char *prog) {
  fprintf(stderr,
          "usage: %s [--seconds S] [--load F] [--max-growth PCT] [--sample-seconds S]\n"
          "          [--warmup-seconds S] [--calibrate-seconds S] [--prime-seconds S] [--window N]\n"
          "          [--admission-bound N] [--backend auto|cpu|cuda] [--cpu-threads N]\n"
          "          [--max-seq N] [--seed N] [MODEL_DIR...]\n",
          prog);
}

static bool parse_double(const char *name, const char *s, double lo, double hi, double *out) {
  char *end = NULL;
  errno = 0;
  double v = s ? strtod(s, &end) : NAN;
  if (s == NULL || end == s || *end != '\0' || errno != 0 || !isfinite(v) || v < lo || v > hi) {
    fprintf(stderr, "soak: %s: \"%s\" is not a number in [%g, %g]\n", name, s ? s : "", lo, hi);
    return false;
  }
  *out = v;
  return true;
}

static bool parse_u64(const char *name, const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long long v = 0;
  bool digits = s != NULL && *s >= '0' && *s <= '9'; /* strtoull would accept "-1" */
  if (digits) v = strtoull(s, &end, 10);
  if (!digits || *end != '\0' || errno != 0 || v < lo || v > hi) {
    fprintf(stderr, "soak: %s: \"%s\" is not an integer in [%" PRIu64 ", %" PRIu64 "]\n", name,
            s ? s : "", lo, hi);
    return false;
  }
  *out = (uint64_t)v;
  return true;
}

static bool parse_args(int argc, char **argv, config *c) {
  *c = (config){.seconds = 1800, .load = 0.8, .max_growth = 1.0, .sample_seconds = 10,
                .warmup_seconds = -1, .calibrate_seconds = 5, .prime_seconds = -1, .window = 128,
                .admission_bound = 4096, .cpu_threads = 0, .max_seq = 16, .seed = 1,
                .backend = "auto"};
  const double week = 7 * 24 * 3600.0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    bool good = true;
    if (a[0] != '-') {
      if (c->n_models == MAX_MODELS) {
        fprintf(stderr, "soak: more than %d models\n", MAX_MODELS);
        return false;
      }
      c->models[c->n_models++] = a;
      continue;
    }
    if (v == NULL || strcmp(a, "--help") == 0) {
      if (strcmp(a, "--help") != 0) fprintf(stderr, "soak: %s needs a value\n", a);
      return false;
    }
    i++;
    if (strcmp(a, "--seconds") == 0) good = parse_double(a, v, 0.001, week, &c->seconds);
    else if (strcmp(a, "--load") == 0) good = parse_double(a, v, 0.001, 10, &c->load);
    else if (strcmp(a, "--max-growth") == 0) good = parse_double(a, v, 0, 1e6, &c->max_growth);
    else if (strcmp(a, "--sample-seconds") == 0)
      good = parse_double(a, v, 0.01, week, &c->sample_seconds);
    else if (strcmp(a, "--warmup-seconds") == 0)
      good = parse_double(a, v, 0, week, &c->warmup_seconds);
    else if (strcmp(a, "--calibrate-seconds") == 0)
      good = parse_double(a, v, 0.1, 3600, &c->calibrate_seconds);
    else if (strcmp(a, "--prime-seconds") == 0)
      good = parse_double(a, v, 0, 3600, &c->prime_seconds);
    else if (strcmp(a, "--window") == 0) good = parse_u64(a, v, 1, 1u << 20, &c->window);
    else if (strcmp(a, "--admission-bound") == 0)
      good = parse_u64(a, v, 1, 1u << 20, &c->admission_bound);
    else if (strcmp(a, "--cpu-threads") == 0) good = parse_u64(a, v, 0, 1024, &c->cpu_threads);
    else if (strcmp(a, "--max-seq") == 0) good = parse_u64(a, v, 1, 4096, &c->max_seq);
    else if (strcmp(a, "--seed") == 0) good = parse_u64(a, v, 0, UINT64_MAX, &c->seed);
    else if (strcmp(a, "--backend") == 0) c->backend = v;
    else {
      fprintf(stderr, "soak: unknown option %s\n", a);
      return false;
    }
    if (!good) return false;
  }
  if (c->n_models == 0) {
    c->models[c->n_models++] = "ffi_examples/testdata/mlp_4_8_3";
    c->models[c->n_models++] = "ffi_examples/testdata/lstm_small";
  }
  if (c->warmup_seconds < 0) c->warmup_seconds = fmin(60, c->seconds / 10);
  if (c->prime_seconds < 0) c->prime_seconds = fmin(10, c->seconds / 20);
  if (c->warmup_seconds >= c->seconds) {
    fprintf(stderr, "soak: --warmup-seconds %g must be shorter than --seconds %g\n",
            c->warmup_seconds, c->seconds);
    return false;
  }
  if (c->window > c->admission_bound) {
    fprintf(stderr, "soak: --window %" PRIu64 " is over the admission bound %" PRIu64 "\n",
            c->window, c->admission_bound);
    return false;
  }
  if (c->seed == 0) c->seed = 1; /* xorshift's one fixed point */
  return true;
}

#endif /* SOAK_CLI_H */
