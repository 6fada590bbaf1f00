/*
 * C shims for the Go bindings: they fold several libserve calls into one cgo call on the hot
 * paths (submit with options; drain a batch of completions and read them). They keep no state
 * and never store or receive Go pointers beyond the duration of a call.
 */
#ifndef LIBSERVE_GO_SHIM_H
#define LIBSERVE_GO_SHIM_H

#include <stddef.h>
#include <stdint.h>

#include "libserve.h"

/* Output kinds of an lsgo_event. */
enum {
  LSGO_OUTPUT_NONE = 0, /* the request failed (code != SERVE_CODE_OK), or no output was readable */
  LSGO_OUTPUT_F32 = 1,
  LSGO_OUTPUT_TOKENS = 2,
};

/* One drained completion, flattened. data and message are borrowed from the completion kept in
 * the parallel completions array and stay valid until lsgo_release frees it. */
typedef struct lsgo_event {
  uint64_t tag;
  uint32_t code;
  uint32_t kind;
  const void *data;    /* float[len] or uint32_t[len], per kind */
  size_t len;
  const char *message; /* NULL unless the request failed */
} lsgo_event;

/* serve_queue_next into completions[0..*count], with events[i] describing completions[i]. */
serve_error *lsgo_next(const serve_queue *queue, serve_completion **completions, lsgo_event *events,
                       size_t max, uint64_t timeout_ns, size_t *count);

/* Free completions[0..count]. */
void lsgo_release(serve_completion **completions, size_t count);

/* Submit options of one request. has_deadline: relative_deadline_ns is the time left until the
 * deadline (≤ 0: already passed, so libserve refuses the request with DEADLINE_EXCEEDED). */
typedef struct lsgo_submit {
  int32_t has_deadline;
  int32_t priority;
  int64_t relative_deadline_ns;
} lsgo_submit;

serve_error *lsgo_submit_f32(const serve_model *model, const serve_queue *queue, uint64_t tag,
                             const float *input, size_t len, lsgo_submit how, uint64_t *request_id);

serve_error *lsgo_submit_tokens(const serve_model *model, const serve_queue *queue, uint64_t tag,
                                const uint32_t *tokens, size_t len, lsgo_submit how,
                                uint64_t *request_id);

serve_error *lsgo_submit_tree(const serve_model *model, const serve_queue *queue, uint64_t tag,
                              const uint32_t *tokens, const int32_t *parents, size_t len,
                              lsgo_submit how, uint64_t *request_id);

#endif /* LIBSERVE_GO_SHIM_H */
