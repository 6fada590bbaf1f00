/*
 * serve.hpp — header-only C++17 RAII wrapper over libserve's C ABI (include/libserve.h).
 *
 * Include it after putting include/ and ffi_examples/cpp/ on the include path, and link
 * libserve (see README, "Install" and "C++ quick start"). Everything lives in namespace `serve`;
 * `serve::detail` is not public API.
 *
 * CONTRACTS (they refine the C header's preamble, which still applies)
 *
 * Errors. Every failing call throws serve::Error (a std::runtime_error) whose code() is the C
 * serve_code and whose what() is "CODE_NAME: message". A refused submit (invalid input, BUSY,
 * a deadline already passed, SHUTDOWN) throws from submit itself and produces no completion; a
 * request that was accepted and then failed (CANCELLED, DEADLINE_EXCEEDED, BACKEND, ...) throws
 * serve::Error from its future's get(). Destructors never throw.
 *
 * Ownership. Runtime, Model, Queue, Completion, Stats and the three option builders each own one
 * C object and free it in their destructor. They are move-only; a moved-from object may only be
 * destroyed or assigned to (other calls throw serve::Error with SERVE_CODE_INVALID_ARGUMENT).
 * Inputs (request data, strings, options) are copied or only read during a call, as in C. Views
 * returned by Completion (Span, message()) borrow from it and are valid until it is destroyed.
 *
 * Threads. Every const member function of Runtime, Model, Queue, Completion and Stats may be
 * called concurrently from any number of threads. Non-const members (option setters, move
 * assignment) and destruction need exclusive access. An option builder may be shared between
 * threads as `const` once set.
 *
 * Futures. Model::submit(), submit_tokens(), submit_tree() (f32 outputs) and submit_decode()
 * (token outputs) return a std::future fulfilled exactly once: with the output, or with a
 * serve::Error. Each Runtime owns one libserve callback-mode completion queue
 * (serve_queue_new_callback) whose callback, running on the thread libserve owns for that queue,
 * moves the output into the std::promise registered under the request's tag. We use the callback
 * queue rather than a wrapper-owned dispatcher thread draining with serve_queue_next because:
 *   - libserve already owns a delivery thread per callback queue, so a dispatcher would be a
 *     second thread doing the same job, plus a polling timeout (serve_queue_next cannot be
 *     woken except by a completion) to notice when to stop;
 *   - teardown is exact: serve_queue_free waits for a callback in progress and guarantees none
 *     afterwards, so no thread has to be joined and no promise can be touched after free;
 *   - the callback meets the C contract: it never blocks (a short map lookup under a mutex, then
 *     std::promise::set_value/set_exception, which only store and wake; std::future has no
 *     continuations that could run user code there) and never lets an exception escape.
 * Callers that want batch draining, an fd for their event loop, or no per-request allocation use
 * Queue + Model::submit_to() instead, exactly as in C.
 *
 * Lifetimes. A Model keeps its Runtime's internal state alive. Destroying a Runtime shuts it down
 * with no drain: every pending request completes with SERVE_CODE_CANCELLED (so every future
 * becomes ready), and Models still alive refuse new requests with SERVE_CODE_SHUTDOWN. The C
 * runtime and the internal queue are freed with the last of the Runtime and its Models.
 */

#ifndef SERVE_HPP
#define SERVE_HPP

#if !defined(__cplusplus) || __cplusplus < 201703L
#error "serve.hpp needs C++17 or later"
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "libserve.h"

namespace serve {

/// A stable status code: the C enum, e.g. SERVE_CODE_BUSY.
using Code = serve_code;

/// The name of a code ("INVALID_ARGUMENT", ...; "UNKNOWN" for a value that is not a code).
/// Static storage. Thread-safe.
inline const char* code_name(Code code) noexcept {
  return serve_code_name(static_cast<std::uint32_t>(code));
}

/// The version of the linked library, "MAJOR.MINOR.PATCH" (static storage). Compare with
/// SERVE_VERSION_MAJOR/MINOR/PATCH to detect a library that does not match the header.
inline const char* version() noexcept { return serve_version(); }

/// Current CLOCK_MONOTONIC time in nanoseconds: the clock of SubmitOptions::deadline_ns().
inline std::uint64_t now_ns() noexcept { return serve_now_ns(); }

/// A duration meaning "no limit" where a timeout is taken (Queue::next, Runtime::shutdown,
/// ModelOptions::max_wait): passed to C as UINT64_MAX.
inline constexpr std::chrono::nanoseconds forever = std::chrono::nanoseconds::max();

/// A libserve error: a stable code and a message. Immutable, cheap to copy (what() is shared),
/// safe to read from several threads.
class Error : public std::runtime_error {
 public:
  /// An error with `code` and `message`; what() is "CODE_NAME: message".
  Error(Code code, const std::string& message)
      : std::runtime_error(std::string(code_name(code)) + ": " + message),
        code_(code),
        prefix_len_(std::char_traits<char>::length(code_name(code)) + 2) {}

  /// The stable code, e.g. SERVE_CODE_INVALID_ARGUMENT.
  Code code() const noexcept { return code_; }

  /// The message without the "CODE_NAME: " prefix. Borrowed from *this.
  const char* message() const noexcept { return what() + prefix_len_; }

 private:
  Code code_;
  std::size_t prefix_len_;
};

/// A read-only view of `size()` contiguous values: the C++17 stand-in for std::span<const T>.
/// Implicitly built from a pointer and a length, a C array, or any container with contiguous
/// data() and size() (std::vector, std::array, std::span in C++20, ...). Does not own its data:
/// the data must outlive the view. Submit functions copy it before they return, so a temporary
/// container is fine there. (No std::initializer_list constructor: a view of a braced list
/// dangles as soon as the statement ends.)
template <class T>
class Span {
  static_assert(std::is_const<T>::value, "serve::Span is read-only: use Span<const T>");

 public:
  /// An empty view.
  constexpr Span() noexcept = default;
  /// `size` values starting at `data`.
  constexpr Span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// A whole C array.
  template <std::size_t N>
  constexpr Span(T (&array)[N]) noexcept : data_(array), size_(N) {}
  /// A contiguous container: anything with data() convertible to T* and size().
  template <class C,
            class = std::enable_if_t<
                !std::is_same<std::decay_t<C>, Span>::value &&
                std::is_convertible<decltype(std::declval<const C&>().data()), T*>::value &&
                std::is_convertible<decltype(std::declval<const C&>().size()), std::size_t>::value>>
  constexpr Span(const C& container) noexcept
      : data_(container.data()), size_(static_cast<std::size_t>(container.size())) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr T* begin() const noexcept { return data_; }
  constexpr T* end() const noexcept { return data_ + size_; }
  /// Element `i`; unchecked, like std::span.
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

namespace detail {

/// unique_ptr deleter calling a libserve `_free` function (all of them accept NULL).
template <class T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* p) const noexcept { Free(p); }
};

template <class T, void (*Free)(T*)>
using Handle = std::unique_ptr<T, Deleter<T, Free>>;

using ErrorHandle = Handle<serve_error, serve_error_free>;

/// Turn an owned serve_error into a serve::Error (freeing it either way).
inline Error to_error(serve_error* raw) {
  ErrorHandle e(raw);
  return Error(serve_error_code(e.get()), serve_error_message(e.get()));
}

/// Throw if a fallible C call failed.
inline void check(serve_error* raw) {
  if (raw != nullptr) throw to_error(raw);
}

[[noreturn]] inline void throw_moved_from(const char* type) {
  throw Error(SERVE_CODE_INVALID_ARGUMENT, std::string("use of a moved-from serve::") + type);
}

/// A timeout for C: negative = 0 (do not wait), `forever` = UINT64_MAX.
inline std::uint64_t timeout_ns(std::chrono::nanoseconds d) noexcept {
  if (d == forever) return std::numeric_limits<std::uint64_t>::max();
  return d.count() <= 0 ? 0 : static_cast<std::uint64_t>(d.count());
}

/// A duration option: negative is refused; `forever` = UINT64_MAX.
inline std::uint64_t option_ns(std::chrono::nanoseconds d, const char* what) {
  if (d.count() < 0) {
    throw Error(SERVE_CODE_INVALID_ARGUMENT, std::string(what) + " must not be negative");
  }
  return timeout_ns(d);
}

/// A lazily created option builder (CRTP base of the public ones): nothing is allocated until the
/// first setter, and an unset builder passes NULL (the defaults) to C.
template <class Derived, class T, serve_error* (*New)(T**), void (*Free)(T*)>
class LazyOptions {
 public:
  /// The C builder, or nullptr while nothing was set (the defaults). Still owned by *this.
  const T* get() const noexcept { return h_.get(); }

 protected:
  /// Apply a C setter to the builder (created on first use); throw on error; return *this.
  template <class... Params, class... Values>
  Derived& set(serve_error* (*setter)(T*, Params...), Values... values) {
    if (!h_) {
      T* raw = nullptr;
      check(New(&raw));
      h_.reset(raw);
    }
    check(setter(h_.get(), values...));
    return static_cast<Derived&>(*this);
  }

 private:
  Handle<T, Free> h_;
};

class Core;

}  // namespace detail

/// Options for Runtime: backend, CPU threads, default admission bound. A default-constructed
/// object allocates nothing and means the C defaults (backend "auto", one CPU thread per core,
/// admission bound 4096). Setters throw serve::Error (INVALID_ARGUMENT) for invalid values and
/// return *this for chaining. Move-only; not thread-safe while being set; shareable as const.
class RuntimeOptions
    : public detail::LazyOptions<RuntimeOptions, serve_runtime_options, serve_runtime_options_new,
                                 serve_runtime_options_free> {
 public:
  /// "auto" (CUDA when usable, else CPU), "cpu" or "cuda".
  RuntimeOptions& backend(const std::string& name) {
    return set(serve_runtime_options_set_backend, name.c_str());
  }
  /// Compute threads of the CPU backend; 0 = one per core.
  RuntimeOptions& cpu_threads(std::uint32_t threads) {
    return set(serve_runtime_options_set_cpu_threads, threads);
  }
  /// Default per-model admission bound: requests accepted and not yet completed before submit
  /// throws SERVE_CODE_BUSY. At least 1.
  RuntimeOptions& admission_bound(std::uint64_t bound) {
    return set(serve_runtime_options_set_admission_bound, bound);
  }
};

/// A batching policy for ModelOptions::policy(): the SERVE_POLICY_* constants.
enum class Policy : std::uint32_t {
  /// The model kind's own policy: timeout batching (no wait) for mlp, cellular batching for
  /// lstm, seq2seq and treelstm.
  automatic = SERVE_POLICY_AUTO,
  /// TF-Serving style timeout batching (fixed-shape models: mlp).
  timeout = SERVE_POLICY_TIMEOUT,
  /// BatchMaker cellular batching (recurrent models).
  cellular = SERVE_POLICY_CELLULAR,
  /// Graph batching with padding, the TF/MXNet baseline (recurrent models).
  padding = SERVE_POLICY_PADDING,
  /// E²bird's elastic batching: workers of fixed batch sizes fed full batches from an input
  /// ring, no timer (fixed-shape models).
  elastic = SERVE_POLICY_ELASTIC,
  /// Adaptive batching on a latency model (fixed-shape models).
  adaptive = SERVE_POLICY_ADAPTIVE,
};

/// Options for Runtime::load_model. A default-constructed object allocates nothing and means the
/// C defaults: the model kind's own policy (timeout batching with max batch 32, max wait 0 and 1
/// worker for mlp; cellular batching with max batch 512 per cell type, 1 worker and 5 tasks
/// submitted ahead for lstm, seq2seq and treelstm), the runtime's admission bound, enough state
/// slots for it, name = directory name. Setters throw serve::Error (INVALID_ARGUMENT) for invalid
/// values and return *this. A policy that does not fit the model's kind makes load_model throw
/// UNSUPPORTED; an option the (chosen or default) policy does not have makes it throw
/// INVALID_ARGUMENT. Move-only; not thread-safe while being set; shareable as const.
class ModelOptions
    : public detail::LazyOptions<ModelOptions, serve_model_options, serve_model_options_new,
                                 serve_model_options_free> {
 public:
  /// The batching policy; Policy::automatic by default. Policy::timeout fits mlp only,
  /// Policy::cellular and Policy::padding recurrent models only (UNSUPPORTED at load otherwise).
  ModelOptions& policy(Policy p) {
    return set(serve_model_options_set_policy, static_cast<std::uint32_t>(p));
  }
  /// Maximum requests (rows) per batched task, under every policy; 1 to 65536.
  ModelOptions& max_batch(std::uint32_t n) {
    return set(serve_model_options_set_max_batch, n);
  }
  /// Longest time the oldest queued request waits for a fuller batch; 0 = none. Not negative.
  /// Timeout policy only.
  ModelOptions& max_wait(std::chrono::nanoseconds wait) {
    return set(serve_model_options_set_max_wait_ns, detail::option_ns(wait, "max_wait"));
  }
  /// Workers (backend streams) executing this model's tasks concurrently, under every policy;
  /// at least 1.
  ModelOptions& workers(std::uint32_t n) {
    return set(serve_model_options_set_workers, n);
  }
  /// Static batching: every task computes max_batch rows, padding the missing ones. Timeout
  /// policy only.
  ModelOptions& pad_to_max(bool pad) {
    return set(serve_model_options_set_pad_to_max, pad);
  }
  /// Tasks a worker may have submitted and unfinished (BatchMaker's MaxTasksToSubmit; default
  /// 5, cellular batching of a Seq2Seq model 2); at least 1. Cellular and padding policies only.
  ModelOptions& max_tasks_to_submit(std::uint32_t n) {
    return set(serve_model_options_set_max_tasks_to_submit, n);
  }
  /// State slots of a recurrent model: one per in-flight sequence, one per node of an in-flight
  /// tree (requests wait for slots; one needing more than there are is refused at submit with
  /// INVALID_ARGUMENT); at least 1.
  ModelOptions& state_slots(std::uint64_t slots) {
    return set(serve_model_options_set_state_slots, slots);
  }
  /// Most bytes of token-gate tables a recurrent model may hold (CPU backend; an LSTM's first
  /// layer with its embedding folded into its input projection); 0 turns folding off. Default
  /// 256 MiB.
  ModelOptions& token_gates_bytes(std::uint64_t bytes) {
    return set(serve_model_options_set_token_gates_bytes, bytes);
  }
  /// Elastic policy: the batch size of each worker (1 to 256 of them, one of size 1); copied.
  ModelOptions& elastic_workers(const std::vector<std::uint32_t>& batch_sizes) {
    return set(serve_model_options_set_elastic_workers, batch_sizes.data(), batch_sizes.size());
  }
  /// Elastic policy: the most rows running at once over every worker (MaxInf); default 32.
  ModelOptions& max_inflight(std::uint32_t n) {
    return set(serve_model_options_set_max_inflight, n);
  }
  /// Elastic policy: slots of the input ring (default 128); a full ring refuses BUSY at once.
  ModelOptions& ring_slots(std::uint32_t slots) {
    return set(serve_model_options_set_ring_slots, slots);
  }
  /// Elastic policy, E-Ebird: the workers' batch sizes to run at load level total_batch (they
  /// sum to it); copied.
  ModelOptions& add_engine_config(std::uint32_t total_batch,
                                  const std::vector<std::uint32_t>& batch_sizes) {
    return set(serve_model_options_add_engine_config, total_batch, batch_sizes.data(),
               batch_sizes.size());
  }
  /// Adaptive policy: the latency bound the batch size is chosen for (> 0; default 100 ms).
  ModelOptions& latency_bound(std::chrono::nanoseconds bound) {
    return set(serve_model_options_set_latency_bound_ns, detail::option_ns(bound, "latency_bound"));
  }
  /// Adaptive policy: 2 (default) uploads the next batch while one computes, 1 is serial.
  ModelOptions& streams(std::uint32_t n) {
    return set(serve_model_options_set_streams, n);
  }
  /// This model's admission bound (overrides the runtime's); at least 1.
  ModelOptions& admission_bound(std::uint64_t bound) {
    return set(serve_model_options_set_admission_bound, bound);
  }
  /// The model's name in messages.
  ModelOptions& name(const std::string& name) {
    return set(serve_model_options_set_name, name.c_str());
  }
};

/// Per-request options: deadline, timeout, priority. A default-constructed object allocates
/// nothing and means "no deadline, priority 0". Reusable across submits; setters return *this.
/// Move-only; not thread-safe while being set; shareable as const by concurrent submits.
class SubmitOptions
    : public detail::LazyOptions<SubmitOptions, serve_submit_options, serve_submit_options_new,
                                 serve_submit_options_free> {
 public:
  /// Absolute deadline on the now_ns() clock (CLOCK_MONOTONIC); 0 clears it. A request not done
  /// by then completes DEADLINE_EXCEEDED; one already past it at submit is refused (throws).
  SubmitOptions& deadline_ns(std::uint64_t deadline) {
    return set(serve_submit_options_set_deadline_ns, deadline);
  }
  /// Deadline relative to each submit; 0 clears it; not negative. With both a deadline and a
  /// timeout, the earlier applies.
  SubmitOptions& timeout(std::chrono::nanoseconds timeout) {
    return set(serve_submit_options_set_timeout_ns, detail::option_ns(timeout, "timeout"));
  }
  /// Larger is served first; equal priorities in arrival order. Default 0.
  SubmitOptions& priority(std::int32_t priority) {
    return set(serve_submit_options_set_priority, priority);
  }
};

/// A finished request taken from a Queue: tag, request id, code, and output or error message.
/// Owns one serve_completion. Move-only; const members are thread-safe. Outputs and messages it
/// returns are borrowed and valid until it is destroyed.
class Completion {
 public:
  /// An empty completion (as after a move).
  Completion() noexcept = default;
  /// Adopt `raw` (which must come from libserve and not be owned elsewhere); frees it.
  explicit Completion(serve_completion* raw) noexcept : h_(raw) {}

  /// The tag given at submit.
  std::uint64_t tag() const { return serve_completion_tag(raw()); }
  /// The request id submit returned.
  std::uint64_t request_id() const { return serve_completion_request_id(raw()); }
  /// SERVE_CODE_OK, or the code the request failed with.
  Code code() const { return serve_completion_code(raw()); }
  /// Whether the request succeeded.
  bool ok() const { return code() == SERVE_CODE_OK; }
  /// The failure message; nullptr when the request succeeded. Borrowed.
  const char* message() const { return serve_completion_message(raw()); }
  /// The f32 output (mlp, lstm, treelstm). Borrowed. Throws serve::Error with the request's code
  /// if it failed, INVALID_ARGUMENT if its output is tokens.
  Span<const float> output_f32() const {
    const float* data = nullptr;
    std::size_t len = 0;
    detail::check(serve_completion_output_f32(raw(), &data, &len));
    return Span<const float>(data, len);
  }
  /// The token output (seq2seq). Borrowed. Throws like output_f32().
  Span<const std::uint32_t> output_tokens() const {
    const std::uint32_t* data = nullptr;
    std::size_t len = 0;
    detail::check(serve_completion_output_tokens(raw(), &data, &len));
    return Span<const std::uint32_t>(data, len);
  }
  /// The C handle (still owned by *this); nullptr if empty.
  const serve_completion* get() const noexcept { return h_.get(); }
  /// Give up ownership: the caller frees the result with serve_completion_free.
  serve_completion* release() noexcept { return h_.release(); }

 private:
  const serve_completion* raw() const {
    if (!h_) detail::throw_moved_from("Completion");
    return h_.get();
  }
  detail::Handle<serve_completion, serve_completion_free> h_;
};

/// A completion queue drained by the caller (serve_queue_new): submit to it with
/// Model::submit_to() and friends, drain with next(), or watch fd() in an event loop. Owns one
/// serve_queue. Move-only; const members are thread-safe (several threads may submit to it and
/// drain it at once). Destroy it only when no thread uses it; completions not yet drained then
/// (or arriving later) are discarded.
class Queue {
 public:
  /// A new, empty queue. Throws serve::Error on failure.
  Queue() {
    serve_queue* raw = nullptr;
    detail::check(serve_queue_new(&raw));
    h_.reset(raw);
  }

  /// Wait up to `timeout` (forever = no limit, 0 = poll) for at least one completion, then take
  /// up to `max` of them. Empty on timeout, and at once when max is 0. The caller owns the
  /// returned completions.
  std::vector<Completion> next(std::size_t max, std::chrono::nanoseconds timeout) const {
    std::vector<Completion> out;
    std::vector<serve_completion*> raw(max);
    out.reserve(max);  // so that adopting below cannot throw and leak
    std::size_t n = 0;
    detail::check(serve_queue_next(get_checked(), raw.data(), max, detail::timeout_ns(timeout), &n));
    for (std::size_t i = 0; i < n; i++) out.emplace_back(raw[i]);
    return out;
  }

  /// A file descriptor readable exactly while completions are pending (Linux eventfd): poll it,
  /// then call next(). Only poll it: never read, write or close it. Valid while *this lives.
  int fd() const {
    std::int32_t fd = -1;
    detail::check(serve_queue_fd(get_checked(), &fd));
    return static_cast<int>(fd);
  }

  /// The C handle (still owned by *this); nullptr if moved-from.
  const serve_queue* get() const noexcept { return h_.get(); }

 private:
  friend class Model;
  const serve_queue* get_checked() const {
    if (!h_) detail::throw_moved_from("Queue");
    return h_.get();
  }
  detail::Handle<serve_queue, serve_queue_free> h_;
};

/// A snapshot of a runtime's counters (Runtime::stats()). Immutable; owns one serve_stats.
/// Move-only; const members are thread-safe.
class Stats {
 public:
  /// Requests accepted by submit.
  std::uint64_t submitted() const noexcept { return serve_stats_submitted(h_.get()); }
  /// Submits refused synchronously (invalid input, busy, shut down, deadline already passed).
  std::uint64_t rejected() const noexcept { return serve_stats_rejected(h_.get()); }
  /// Requests completed with `code`.
  std::uint64_t completed(Code code) const noexcept {
    return serve_stats_completed(h_.get(), static_cast<std::uint32_t>(code));
  }
  /// Requests completed, whatever their code.
  std::uint64_t completed_total() const noexcept { return serve_stats_completed_total(h_.get()); }
  /// Requests waiting in a scheduler queue.
  std::uint64_t queued() const noexcept { return serve_stats_queued(h_.get()); }
  /// Requests in tasks executing on the backend.
  std::uint64_t running() const noexcept { return serve_stats_running(h_.get()); }
  /// Requests accepted and not yet completed.
  std::uint64_t in_flight() const noexcept { return serve_stats_in_flight(h_.get()); }
  /// Batched tasks launched on the backend.
  std::uint64_t tasks_launched() const noexcept { return serve_stats_tasks_launched(h_.get()); }
  /// Requests carried by launched tasks (padding excluded).
  std::uint64_t batched_requests() const noexcept {
    return serve_stats_batched_requests(h_.get());
  }
  /// Fixed-shape inputs copied into their model's input ring at arrival (elastic batching).
  std::uint64_t ring_copies() const noexcept { return serve_stats_ring_copies(h_.get()); }
  /// Rows copied into a batch's input at launch (every fixed-shape policy but elastic).
  std::uint64_t gather_copies() const noexcept { return serve_stats_gather_copies(h_.get()); }
  /// Nanoseconds the engine thread spent working (parked the rest of the time): its growth over
  /// a wall-clock interval is the thread's utilization.
  std::uint64_t engine_busy_ns() const noexcept { return serve_stats_engine_busy_ns(h_.get()); }
  /// The C handle (still owned by *this).
  const serve_stats* get() const noexcept { return h_.get(); }

 private:
  friend class Runtime;
  explicit Stats(serve_stats* raw) noexcept : h_(raw) {}
  detail::Handle<serve_stats, serve_stats_free> h_;
};

/// What the Model::submit*_with_id() functions return: the request id (for Runtime::cancel) and
/// the future of its output `T`.
template <class T>
struct BasicSubmitted {
  std::uint64_t id;
  std::future<T> result;
};

/// A request with an f32 output (Model::submit_with_id, submit_tokens_with_id,
/// submit_tree_with_id).
using Submitted = BasicSubmitted<std::vector<float>>;

/// A request with a token output (Model::submit_decode_with_id: seq2seq).
using SubmittedTokens = BasicSubmitted<std::vector<std::uint32_t>>;

namespace detail {

/// State shared by a Runtime and its Models: the C runtime, the callback queue that fulfils
/// futures, and the promises of requests in flight keyed by tag. Not public API.
class Core {
 public:
  explicit Core(const serve_runtime_options* options) {
    serve_runtime* rt = nullptr;
    check(serve_runtime_new(options, &rt));
    rt_.reset(rt);
    serve_queue* q = nullptr;
    check(serve_queue_new_callback(&Core::on_completion, this, &q));
    queue_.reset(q);
  }

  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  ~Core() {
    // Everything accepted completes into the queue before shutdown returns (idempotent; ~Runtime
    // has normally done it already); the callback thread then delivers it.
    serve_error_free(serve_runtime_shutdown(rt_.get(), 0));
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kDeliveryGrace, [this] { return pending_.empty(); });
    }
    queue_.reset();  // waits for a callback in progress; none runs afterwards
    // Only a libserve bug leaves promises here; fail them rather than break them silently.
    try {
      for (auto& entry : pending_) {
        fail(entry.second,
             Error(SERVE_CODE_INTERNAL,
                   "libserve did not deliver this request's completion after shutdown"));
      }
    } catch (...) {
      // Out of memory building the error: the remaining futures report broken_promise.
    }
    pending_.clear();
  }

  const serve_runtime* runtime() const noexcept { return rt_.get(); }

  void shutdown(std::chrono::nanoseconds drain) const {
    check(serve_runtime_shutdown(rt_.get(), timeout_ns(drain)));
  }

  /// Register a promise of output `T` under a new tag, then submit with
  /// `call(queue, tag, &request_id)` (one of the serve_submit_* functions).
  template <class T, class Call>
  BasicSubmitted<T> submit(Call&& call) {
    const std::uint64_t tag = next_tag_.fetch_add(1, std::memory_order_relaxed);
    BasicSubmitted<T> s{0, {}};
    {
      // Registered before submitting: the completion may arrive before serve_submit_* returns.
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_
                    .emplace(std::piecewise_construct, std::forward_as_tuple(tag),
                             std::forward_as_tuple(std::in_place_type<std::promise<T>>))
                    .first;
      s.result = std::get<std::promise<T>>(it->second).get_future();
    }
    serve_error* err = call(queue_.get(), tag, &s.id);
    if (err != nullptr) {
      ErrorHandle owned(err);
      {
        std::lock_guard<std::mutex> lock(mu_);
        pending_.erase(tag);  // a refused submit produces no completion
      }
      throw to_error(owned.release());
    }
    return s;
  }

 private:
  /// The promise of a request in flight: of an f32 or a token output, as its submit chose.
  using Promise =
      std::variant<std::promise<std::vector<float>>, std::promise<std::vector<std::uint32_t>>>;
  static constexpr std::chrono::seconds kDeliveryGrace{10};

  static void fail_with(Promise& p, std::exception_ptr e) noexcept {
    std::visit(
        [&](auto& promise) {
          try {
            promise.set_exception(e);
          } catch (...) {
            // Already satisfied: nothing to do.
          }
        },
        p);
  }

  static void fail(Promise& p, const Error& e) noexcept {
    try {
      fail_with(p, std::make_exception_ptr(e));
    } catch (...) {
      // Out of memory copying the error: the future reports broken_promise.
    }
  }

  /// Fulfil `p` with the output of the successful completion `c`; throws serve::Error if the
  /// output is of the other type (INVALID_ARGUMENT).
  static void set_output(std::promise<std::vector<float>>& p, const serve_completion* c) {
    const float* data = nullptr;
    std::size_t len = 0;
    check(serve_completion_output_f32(c, &data, &len));
    p.set_value(std::vector<float>(data, data + len));
  }
  static void set_output(std::promise<std::vector<std::uint32_t>>& p, const serve_completion* c) {
    const std::uint32_t* data = nullptr;
    std::size_t len = 0;
    check(serve_completion_output_tokens(c, &data, &len));
    p.set_value(std::vector<std::uint32_t>(data, data + len));
  }

  /// Runs on libserve's callback thread: must not block and must not throw.
  static void on_completion(void* user_data, serve_completion* raw) noexcept {
    Handle<serve_completion, serve_completion_free> c(raw);
    Core* self = static_cast<Core*>(user_data);
    std::optional<Promise> p;  // empty until found: a default std::promise would allocate
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->pending_.find(serve_completion_tag(raw));
      if (it != self->pending_.end()) {
        p.emplace(std::move(it->second));  // noexcept move
        self->pending_.erase(it);
      }
    }
    if (p) {
      try {
        if (serve_completion_code(raw) == SERVE_CODE_OK) {
          std::visit([&](auto& promise) { set_output(promise, raw); }, *p);
        } else {
          const char* msg = serve_completion_message(raw);
          fail_with(*p, std::make_exception_ptr(Error(serve_completion_code(raw),
                                                      msg != nullptr ? msg : "request failed")));
        }
      } catch (...) {
        fail_with(*p, std::current_exception());
      }
    }
    // ~Core waits for the map to empty; it cannot finish before this callback returns.
    self->cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::uint64_t, Promise> pending_;
  std::atomic<std::uint64_t> next_tag_{1};
  Handle<serve_runtime, serve_runtime_free> rt_;
  Handle<serve_queue, serve_queue_free> queue_;  // declared last: freed first
};

}  // namespace detail

/// A model loaded into a Runtime (Runtime::load_model). Owns one serve_model and shares its
/// Runtime's internal state. Move-only; every const member is thread-safe: submit from any number
/// of threads. Outlives its Runtime safely: submits then throw SERVE_CODE_SHUTDOWN.
class Model {
 public:
  /// Submit an f32 vector (mlp); the future yields the output or throws serve::Error (CANCELLED,
  /// DEADLINE_EXCEEDED, BACKEND, ...). `input` is copied before this returns. Throws
  /// serve::Error if the request is refused: INVALID_ARGUMENT (empty or wrong-length input, a
  /// model that does not take f32), DEADLINE_EXCEEDED (deadline already passed), BUSY (admission
  /// bound full: retry later), SHUTDOWN.
  std::future<std::vector<float>> submit(Span<const float> input,
                                         const SubmitOptions& options = SubmitOptions()) const {
    return submit_with_id(input, options).result;
  }

  /// submit(), also returning the request id for Runtime::cancel().
  Submitted submit_with_id(Span<const float> input,
                           const SubmitOptions& options = SubmitOptions()) const {
    const serve_model* m = get_checked();
    const serve_submit_options* o = options.get();
    return core().submit<std::vector<float>>(
        [&](const serve_queue* q, std::uint64_t tag, std::uint64_t* id) {
          return serve_submit_f32(m, q, tag, input.data(), input.size(), o, id);
        });
  }

  /// Submit a token sequence to a model with an f32 output (lstm: the future yields the final
  /// hidden state, output_len() values). `tokens` is copied before this returns. Throws as
  /// submit() does; INVALID_ARGUMENT also for an empty sequence, a token id at or above the
  /// vocabulary, a sequence too long, a model that does not take tokens, and a seq2seq model
  /// (its output is tokens: use submit_decode()).
  std::future<std::vector<float>> submit_tokens(Span<const std::uint32_t> tokens,
                                                const SubmitOptions& options = SubmitOptions()) const {
    return submit_tokens_with_id(tokens, options).result;
  }

  /// submit_tokens(), also returning the request id for Runtime::cancel().
  Submitted submit_tokens_with_id(Span<const std::uint32_t> tokens,
                                  const SubmitOptions& options = SubmitOptions()) const {
    const serve_model* m = get_checked();
    if (token_output(m)) {
      throw Error(SERVE_CODE_INVALID_ARGUMENT,
                  std::string("a `") + serve_model_kind(m) +
                      "` model outputs tokens: use submit_decode()");
    }
    return submit_tokens_as<std::vector<float>>(m, tokens, options);
  }

  /// Submit a token sequence to a model with a token output (seq2seq: the future yields the
  /// decoded token ids). Throws as submit_tokens() does; INVALID_ARGUMENT also for a model whose
  /// output is f32 values (use submit_tokens()).
  std::future<std::vector<std::uint32_t>> submit_decode(
      Span<const std::uint32_t> tokens, const SubmitOptions& options = SubmitOptions()) const {
    return submit_decode_with_id(tokens, options).result;
  }

  /// submit_decode(), also returning the request id for Runtime::cancel().
  SubmittedTokens submit_decode_with_id(Span<const std::uint32_t> tokens,
                                        const SubmitOptions& options = SubmitOptions()) const {
    const serve_model* m = get_checked();
    if (!token_output(m)) {
      throw Error(SERVE_CODE_INVALID_ARGUMENT,
                  std::string("a `") + serve_model_kind(m) +
                      "` model does not output tokens: use submit_tokens() or submit()");
    }
    return submit_tokens_as<std::vector<std::uint32_t>>(m, tokens, options);
  }

  /// Submit a tree (treelstm): node i has token tokens[i] (4294967295 = none) and parent
  /// parents[i] (-1 for the root), in any node order; the future yields the root's final hidden
  /// state (output_len() values). Both views are copied before this returns. Throws as submit()
  /// does; INVALID_ARGUMENT also for views of different lengths (checked here: not a libserve
  /// rejection), a malformed tree (empty, no root, two roots, a cycle, a parent out of range:
  /// the message names the node), a token id at or above the vocabulary, a tree needing more
  /// state slots than the model has, and a model that does not take trees.
  std::future<std::vector<float>> submit_tree(Span<const std::uint32_t> tokens,
                                              Span<const std::int32_t> parents,
                                              const SubmitOptions& options = SubmitOptions()) const {
    return submit_tree_with_id(tokens, parents, options).result;
  }

  /// submit_tree(), also returning the request id for Runtime::cancel().
  Submitted submit_tree_with_id(Span<const std::uint32_t> tokens, Span<const std::int32_t> parents,
                                const SubmitOptions& options = SubmitOptions()) const {
    const serve_model* m = get_checked();
    check_tree_lengths(tokens, parents);
    const serve_submit_options* o = options.get();
    return core().submit<std::vector<float>>(
        [&](const serve_queue* q, std::uint64_t tag, std::uint64_t* id) {
          return serve_submit_tree(m, q, tag, tokens.data(), parents.data(), tokens.size(), o, id);
        });
  }

  /// Submit an f32 vector whose completion goes to `queue` with `tag` (no future). Returns the
  /// request id. Refusals throw as for submit(); an accepted request completes exactly once into
  /// `queue`, which must outlive it or lose it.
  std::uint64_t submit_to(const Queue& queue, std::uint64_t tag, Span<const float> input,
                          const SubmitOptions& options = SubmitOptions()) const {
    std::uint64_t id = 0;
    detail::check(serve_submit_f32(get_checked(), queue.get_checked(), tag, input.data(),
                                   input.size(), options.get(), &id));
    return id;
  }

  /// Submit a token sequence (lstm, seq2seq) to `queue`; like submit_to(). A token id at or
  /// above the vocabulary, or a sequence too long, is INVALID_ARGUMENT.
  std::uint64_t submit_tokens_to(const Queue& queue, std::uint64_t tag,
                                 Span<const std::uint32_t> tokens,
                                 const SubmitOptions& options = SubmitOptions()) const {
    std::uint64_t id = 0;
    detail::check(serve_submit_tokens(get_checked(), queue.get_checked(), tag, tokens.data(),
                                      tokens.size(), options.get(), &id));
    return id;
  }

  /// Submit a tree (treelstm) to `queue`: node i has token tokens[i] (4294967295 = none) and
  /// parent parents[i] (-1 for the root). The two views must have the same length
  /// (INVALID_ARGUMENT otherwise); a malformed tree is INVALID_ARGUMENT naming the node.
  std::uint64_t submit_tree_to(const Queue& queue, std::uint64_t tag,
                               Span<const std::uint32_t> tokens, Span<const std::int32_t> parents,
                               const SubmitOptions& options = SubmitOptions()) const {
    check_tree_lengths(tokens, parents);
    std::uint64_t id = 0;
    detail::check(serve_submit_tree(get_checked(), queue.get_checked(), tag, tokens.data(),
                                    parents.data(), tokens.size(), options.get(), &id));
    return id;
  }

  /// "mlp", "lstm", "seq2seq" or "treelstm" (static storage).
  const char* kind() const { return serve_model_kind(get_checked()); }
  /// Values in one request's input for fixed-shape models (mlp); 0 otherwise.
  std::size_t input_len() const { return serve_model_input_len(get_checked()); }
  /// Values in one request's output for models with a fixed output size.
  std::size_t output_len() const { return serve_model_output_len(get_checked()); }
  /// The C handle (still owned by *this); nullptr if moved-from.
  const serve_model* get() const noexcept { return h_.get(); }

  /// For a model of Runtime::add_tenants: whether its whole chain of layers meets its QoS target
  /// alone on every core of the pool (when not, it is served best-effort). Throws
  /// INVALID_ARGUMENT for a model that is not a tenant.
  bool tenant_feasible() const {
    bool out = false;
    detail::check(serve_model_tenant_feasible(get_checked(), &out));
    return out;
  }

  /// For a model of Runtime::add_tenants: its profiled time alone on every core of the pool.
  /// Throws INVALID_ARGUMENT for a model that is not a tenant.
  std::chrono::nanoseconds tenant_solo() const {
    std::uint64_t ns = 0;
    detail::check(serve_model_tenant_solo_ns(get_checked(), &ns));
    return std::chrono::nanoseconds(static_cast<std::chrono::nanoseconds::rep>(ns));
  }

 private:
  friend class Runtime;
  Model(std::shared_ptr<detail::Core> core, serve_model* raw) noexcept
      : core_(std::move(core)), h_(raw) {}
  const serve_model* get_checked() const {
    if (!h_) detail::throw_moved_from("Model");
    return h_.get();
  }
  /// Whether the model's outputs are tokens (seq2seq) rather than f32 values.
  static bool token_output(const serve_model* m) noexcept {
    return std::strcmp(serve_model_kind(m), "seq2seq") == 0;
  }
  static void check_tree_lengths(Span<const std::uint32_t> tokens,
                                 Span<const std::int32_t> parents) {
    if (tokens.size() != parents.size()) {
      throw Error(SERVE_CODE_INVALID_ARGUMENT, "tree has " + std::to_string(tokens.size()) +
                                                   " tokens but " +
                                                   std::to_string(parents.size()) + " parents");
    }
  }
  template <class T>
  BasicSubmitted<T> submit_tokens_as(const serve_model* m, Span<const std::uint32_t> tokens,
                                     const SubmitOptions& options) const {
    const serve_submit_options* o = options.get();
    return core().submit<T>([&](const serve_queue* q, std::uint64_t tag, std::uint64_t* id) {
      return serve_submit_tokens(m, q, tag, tokens.data(), tokens.size(), o, id);
    });
  }
  detail::Core& core() const {
    if (!core_) detail::throw_moved_from("Model");
    return *core_;
  }
  // Declared first so destroyed last: the model handle goes before the runtime state.
  std::shared_ptr<detail::Core> core_;
  detail::Handle<serve_model, serve_model_free> h_;
};

/// A group of layer models sharing the CPU cores under libserve's tenant scheduler (VELTAIR), each
/// with its own QoS target, for Runtime::add_tenants. Defaults: scheme "veltair", every CPU (at
/// most the CPU backend's threads), 5 interference levels 0.25 apart, the runtime's admission
/// bound. Adders and setters throw serve::Error as their C functions fail (serve_tenants_*) and
/// return *this. Move-only; not thread-safe while being filled; shareable as const.
class Tenants {
 public:
  Tenants() {
    serve_tenants* raw = nullptr;
    detail::check(serve_tenants_new(&raw));
    h_.reset(raw);
  }
  /// The layer model in `dir` (loaded now; NOT_FOUND, FORMAT as load_model), named `name` (empty:
  /// the directory's name), whose queries should complete within `qos` (1 ns to one hour).
  Tenants& add_model(const std::string& dir, const std::string& name, std::chrono::nanoseconds qos) {
    detail::check(serve_tenants_add_model(get_checked(), dir.c_str(), name.empty() ? nullptr : name.c_str(),
                                          detail::option_ns(qos, "qos")));
    return *this;
  }
  /// A custom model with its layers declared (C options, only read; see libserve.h).
  Tenants& add_custom_model(const serve_custom_model_options* options, const std::string& name,
                            std::chrono::nanoseconds qos) {
    detail::check(
        serve_tenants_add_custom_model(get_checked(), options, name.c_str(), detail::option_ns(qos, "qos")));
    return *this;
  }
  /// "veltair", "veltair-as", "veltair-ac", "layer-wise", "model-wise", "fixed-N" or "prema".
  Tenants& scheme(const std::string& name) {
    detail::check(serve_tenants_set_scheme(get_checked(), name.c_str()));
    return *this;
  }
  /// The first `cores` CPUs the calling thread may run on; 0 = all of them.
  Tenants& cores(std::size_t cores) {
    detail::check(serve_tenants_set_cores(get_checked(), cores));
    return *this;
  }
  /// Interference levels (1 to 16) and the slowdown one level adds (0 to 10).
  Tenants& levels(std::size_t levels, double level_step) {
    detail::check(serve_tenants_set_levels(get_checked(), levels, level_step));
    return *this;
  }
  /// Each tenant's admission bound; at least 1.
  Tenants& admission_bound(std::size_t bound) {
    detail::check(serve_tenants_set_admission_bound(get_checked(), bound));
    return *this;
  }
  /// Models added so far.
  std::size_t size() const noexcept { return serve_tenants_len(h_.get()); }
  /// The C handle (still owned by *this); nullptr if moved-from.
  const serve_tenants* get() const noexcept { return h_.get(); }

 private:
  serve_tenants* get_checked() const {
    if (!h_) detail::throw_moved_from("Tenants");
    return h_.get();
  }
  detail::Handle<serve_tenants, serve_tenants_free> h_;
};

/// A libserve runtime: backend, engine threads, loaded models, plus the callback queue that
/// fulfils the futures of Model::submit() and its siblings (one libserve-owned thread).
/// Move-only; every const member is thread-safe. Destroying it shuts it down with no drain (see
/// "Lifetimes" at the top): pending requests complete CANCELLED, Models still alive then refuse
/// submits with SHUTDOWN.
class Runtime {
 public:
  /// Start a runtime. `options` is only read. Throws serve::Error (e.g. UNAVAILABLE for
  /// backend "cuda" without a usable GPU).
  explicit Runtime(const RuntimeOptions& options = RuntimeOptions())
      : core_(std::make_shared<detail::Core>(options.get())) {}

  Runtime(Runtime&&) noexcept = default;
  /// Shuts the runtime held so far down (as the destructor does), then takes `other`'s.
  Runtime& operator=(Runtime&& other) noexcept {
    if (this != &other) {
      close();
      core_ = std::move(other.core_);
    }
    return *this;
  }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  ~Runtime() { close(); }

  /// Load the model directory `dir` (model.toml + weights.safetensors). Throws serve::Error:
  /// NOT_FOUND, FORMAT, UNSUPPORTED (a policy that does not fit the model's kind),
  /// INVALID_ARGUMENT (an option the policy does not have), SHUTDOWN.
  Model load_model(const std::string& dir, const ModelOptions& options = ModelOptions()) const {
    serve_model* raw = nullptr;
    detail::check(serve_runtime_load_model(core().runtime(), dir.c_str(), options.get(), &raw));
    return Model(core_, raw);
  }

  /// Serve the group's models as tenants sharing the CPU cores (serve_runtime_add_tenants): each
  /// is profiled first (milliseconds to seconds), then all serve together. Returns one Model per
  /// model added, in order. Throws serve::Error: UNSUPPORTED (a device backend),
  /// INVALID_ARGUMENT (no tenant, a model without layers, too many cores), an error naming a
  /// layer that cannot be profiled, SHUTDOWN.
  std::vector<Model> add_tenants(const Tenants& tenants) const {
    if (tenants.get() == nullptr) detail::throw_moved_from("Tenants");
    std::vector<serve_model*> raw(tenants.size(), nullptr);
    std::vector<Model> models;
    models.reserve(raw.size());  // before the call: nothing below may throw once handles exist
    detail::check(serve_runtime_add_tenants(core().runtime(), tenants.get(), raw.data(), raw.size()));
    for (serve_model* m : raw) models.push_back(Model(core_, m));
    return models;
  }

  /// Stop accepting requests, let pending ones finish for up to `drain` (forever = no limit),
  /// complete the rest CANCELLED, stop the runtime's threads. Blocks until done. Idempotent.
  void shutdown(std::chrono::nanoseconds drain = forever) const { core().shutdown(drain); }

  /// Ask for request `request_id` (from submit_with_id or submit_to) to be cancelled; its future
  /// or completion then reports CANCELLED, unless it already completed. Throws INVALID_ARGUMENT
  /// only for an id this runtime never issued.
  void cancel(std::uint64_t request_id) const {
    detail::check(serve_runtime_cancel(core().runtime(), request_id));
  }

  /// A snapshot of the counters.
  Stats stats() const {
    serve_stats* raw = nullptr;
    detail::check(serve_runtime_stats(core().runtime(), &raw));
    return Stats(raw);
  }

  /// The runtime's metrics as OpenMetrics text, ending with "# EOF\n" (serve_runtime_metrics;
  /// serve it with the content type
  /// `application/openmetrics-text; version=1.0.0; charset=utf-8`).
  std::string metrics() const {
    serve_metrics* raw = nullptr;
    detail::check(serve_runtime_metrics(core().runtime(), &raw));
    detail::Handle<serve_metrics, serve_metrics_free> h(raw);
    std::size_t len = 0;
    const char* text = serve_metrics_text(h.get(), &len);
    return std::string(text, len);
  }

  /// The backend in use: "cpu" or "cuda" (static storage).
  const char* backend() const { return serve_runtime_backend(core().runtime()); }

  /// The C handle, for calls the wrapper does not cover (still owned here); nullptr if
  /// moved-from. Do not free it.
  const serve_runtime* get() const noexcept { return core_ ? core_->runtime() : nullptr; }

 private:
  detail::Core& core() const {
    if (!core_) detail::throw_moved_from("Runtime");
    return *core_;
  }
  void close() noexcept {
    if (core_) {
      serve_error_free(serve_runtime_shutdown(core_->runtime(), 0));
      core_.reset();
    }
  }
  std::shared_ptr<detail::Core> core_;
};

}  // namespace serve

#endif  // SERVE_HPP
