/* C shims for the Go bindings; see shim.h. */

#include "shim.h"

serve_error *lsgo_next(const serve_queue *queue, serve_completion **completions, lsgo_event *events,
                       size_t max, uint64_t timeout_ns, size_t *count) {
  size_t n = 0;
  serve_error *err = serve_queue_next(queue, completions, max, timeout_ns, &n);
  if (err != NULL) {
    return err;
  }
  for (size_t i = 0; i < n; i++) {
    const serve_completion *c = completions[i];
    lsgo_event *ev = &events[i];
    ev->tag = serve_completion_tag(c);
    ev->code = (uint32_t)serve_completion_code(c);
    ev->kind = LSGO_OUTPUT_NONE;
    ev->data = NULL;
    ev->len = 0;
    ev->message = NULL;
    if (ev->code != SERVE_CODE_OK) {
      ev->message = serve_completion_message(c);
      continue;
    }
    const float *f = NULL;
    size_t len = 0;
    serve_error *e = serve_completion_output_f32(c, &f, &len);
    if (e == NULL) {
      ev->kind = LSGO_OUTPUT_F32;
      ev->data = f;
      ev->len = len;
      continue;
    }
    serve_error_free(e);
    const uint32_t *t = NULL;
    e = serve_completion_output_tokens(c, &t, &len);
    if (e == NULL) {
      ev->kind = LSGO_OUTPUT_TOKENS;
      ev->data = t;
      ev->len = len;
      continue;
    }
    /* Neither output is readable from a successful completion: left SERVE_CODE_OK with no output,
       which the Go side reports as INTERNAL ("succeeded but holds no output"). */
    serve_error_free(e);
  }
  *count = n;
  return NULL;
}

void lsgo_release(serve_completion **completions, size_t count) {
  for (size_t i = 0; i < count; i++) {
    serve_completion_free(completions[i]);
    completions[i] = NULL;
  }
}

/* Options for one submit, or NULL (*out) when the defaults apply. */
static serve_error *make_options(lsgo_submit how, serve_submit_options **out) {
  *out = NULL;
  if (!how.has_deadline && how.priority == 0) {
    return NULL;
  }
  serve_submit_options *o = NULL;
  serve_error *err = serve_submit_options_new(&o);
  if (err != NULL) {
    return err;
  }
  if (how.has_deadline) {
    /* 0 would clear the deadline; 1 is long past, so libserve refuses the request. */
    uint64_t deadline = 1;
    if (how.relative_deadline_ns > 0) {
      uint64_t now = serve_now_ns();
      uint64_t rel = (uint64_t)how.relative_deadline_ns;
      deadline = rel > UINT64_MAX - now ? UINT64_MAX : now + rel;
    }
    err = serve_submit_options_set_deadline_ns(o, deadline);
  }
  if (err == NULL && how.priority != 0) {
    err = serve_submit_options_set_priority(o, how.priority);
  }
  if (err != NULL) {
    serve_submit_options_free(o);
    return err;
  }
  *out = o;
  return NULL;
}

serve_error *lsgo_submit_f32(const serve_model *model, const serve_queue *queue, uint64_t tag,
                             const float *input, size_t len, lsgo_submit how, uint64_t *request_id) {
  serve_submit_options *o;
  serve_error *err = make_options(how, &o);
  if (err == NULL) {
    err = serve_submit_f32(model, queue, tag, input, len, o, request_id);
    serve_submit_options_free(o);
  }
  return err;
}

serve_error *lsgo_submit_tokens(const serve_model *model, const serve_queue *queue, uint64_t tag,
                                const uint32_t *tokens, size_t len, lsgo_submit how,
                                uint64_t *request_id) {
  serve_submit_options *o;
  serve_error *err = make_options(how, &o);
  if (err == NULL) {
    err = serve_submit_tokens(model, queue, tag, tokens, len, o, request_id);
    serve_submit_options_free(o);
  }
  return err;
}

serve_error *lsgo_submit_tree(const serve_model *model, const serve_queue *queue, uint64_t tag,
                              const uint32_t *tokens, const int32_t *parents, size_t len,
                              lsgo_submit how, uint64_t *request_id) {
  serve_submit_options *o;
  serve_error *err = make_options(how, &o);
  if (err == NULL) {
    err = serve_submit_tree(model, queue, tag, tokens, parents, len, o, request_id);
    serve_submit_options_free(o);
  }
  return err;
}
