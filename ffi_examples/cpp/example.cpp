/*
 * example.cpp — a C++ consumer of libserve through the header-only wrapper serve.hpp.
 *
 * Usage: example [MODEL_DIR [LSTM_DIR TREELSTM_DIR SEQ2SEQ_DIR RECURRENT_FILE]]
 *
 *   MODEL_DIR  an `mlp` model directory holding model.toml, weights.safetensors and
 *              expected.json ({"inputs": [[...], ...], "outputs": [[...], ...]}: output k is what
 *              the model must compute for input k). Default: ffi_examples/testdata/mlp_4_8_3,
 *              the committed fixture (tests/fixtures.rs keeps it current).
 *   LSTM_DIR, TREELSTM_DIR, SEQ2SEQ_DIR
 *              an `lstm`, a `treelstm` and a `seq2seq` model directory (the committed fixtures
 *              ffi_examples/testdata/{lstm,treelstm,seq2seq}_small).
 *   RECURRENT_FILE
 *              whitespace-separated text, their requests and expected outputs (tests/cpp_example.rs
 *              writes it from the fixtures' expected.json): `LSTM K` then K records
 *              `LEN TOKENS... OUT_LEN OUTPUT...`; `TREE K` then K records
 *              `N TOKENS... PARENTS... OUT_LEN OUTPUT...` (token 4294967295 = no input, parent -1
 *              = root); `SEQ2SEQ K` then K records `LEN TOKENS... OUT_LEN OUTPUT_TOKENS...`.
 *
 * What it checks: header version against serve::version(); option validation (serve::Error
 * with INVALID_ARGUMENT); NOT_FOUND on a missing model; model metadata; 4 threads submitting
 * futures concurrently (retrying on BUSY) with every output checked against expected.json
 * (relative tolerance 1e-4, absolute below magnitude 1); refused submits throwing the right code
 * and producing no completion; a deadline expiring (DEADLINE_EXCEEDED from the future); cancel
 * (CANCELLED from the future); the tenant mode (two mlp tenants sharing the cores); the
 * caller-drained Queue API (batch next(), fd(), Completion
 * outputs); stats consistency; shutdown (pending futures complete, later submits and loads throw
 * SHUTDOWN); moves; a Model outliving its Runtime; futures resolving when everything is
 * destroyed. With the recurrent arguments also, under the cellular and the padding policy: lstm
 * (submit_tokens), treelstm (submit_tree) and seq2seq (submit_decode) requests from 4 threads at
 * once and through a caller-drained Queue, every output checked (f32 as above, tokens exactly);
 * malformed sequences and trees refused with INVALID_ARGUMENT; a policy that does not fit the
 * kind refused with UNSUPPORTED and an option the policy lacks with INVALID_ARGUMENT; cancel by
 * request id. It also calls into include_twice.cpp, which includes both headers twice.
 *
 * Prints `FAIL: ...` for each failed check and exits 1; exits 0 after printing
 * `example.cpp: all checks passed` only when every check passed.
 *
 * Build (what tests/cpp_example.rs does; SERVE_CPP_SANITIZE=1 adds -fsanitize=address,undefined):
 *   c++ -std=c++17 -Wall -Wextra -Werror -pthread -I include -I ffi_examples/cpp \
 *       ffi_examples/cpp/example.cpp ffi_examples/cpp/example_recurrent.cpp \
 *       ffi_examples/cpp/include_twice.cpp \
 *       target/debug/libserve.a -ldl -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc -o example
 */

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "example_check.hpp"
#include "serve.hpp"

// Defined in include_twice.cpp.
const char* include_twice_busy_name();
std::uint64_t include_twice_unset_options_are_null();

namespace {

using namespace example;

// The wrapper's handles are move-only.
static_assert(!std::is_copy_constructible<serve::Runtime>::value, "Runtime is move-only");
static_assert(std::is_nothrow_move_constructible<serve::Runtime>::value, "Runtime moves");
static_assert(!std::is_copy_constructible<serve::Model>::value, "Model is move-only");
static_assert(std::is_nothrow_move_constructible<serve::Model>::value, "Model moves");
static_assert(!std::is_copy_constructible<serve::Queue>::value, "Queue is move-only");
static_assert(!std::is_copy_constructible<serve::Completion>::value, "Completion is move-only");
static_assert(!std::is_copy_constructible<serve::SubmitOptions>::value, "options are move-only");
static_assert(std::is_base_of<std::runtime_error, serve::Error>::value, "Error is runtime_error");

/* -------------------------------------------------------------------------------------------
 * expected.json: {"inputs": [[number, ...], ...], "outputs": [[number, ...], ...]}
 * ----------------------------------------------------------------------------------------- */

struct Expected {
  std::vector<Vec> inputs, outputs;
};

/// A minimal reader for an array of arrays of numbers following `"key":`. Throws on anything
/// else (objects, strings, nulls are never in expected.json).
std::vector<Vec> json_matrix(const std::string& text, const std::string& key) {
  const std::string quoted = "\"" + key + "\"";
  std::size_t pos = text.find(quoted);
  if (pos == std::string::npos) throw std::runtime_error("no \"" + key + "\" key");
  pos += quoted.size();
  auto skip = [&] {
    while (pos < text.size() && std::isspace(static_cast<unsigned char>(text[pos]))) pos++;
  };
  auto expect = [&](char c) {
    skip();
    if (pos >= text.size() || text[pos] != c) {
      throw std::runtime_error(std::string("expected '") + c + "' at offset " +
                               std::to_string(pos) + " in \"" + key + "\"");
    }
    pos++;
  };
  auto next_is = [&](char c) {
    skip();
    return pos < text.size() && text[pos] == c;
  };
  expect(':');
  expect('[');
  std::vector<Vec> rows;
  while (!next_is(']')) {
    if (!rows.empty()) expect(',');
    expect('[');
    Vec row;
    while (!next_is(']')) {
      if (!row.empty()) expect(',');
      skip();
      const char* start = text.c_str() + pos;
      char* end = nullptr;
      double v = std::strtod(start, &end);
      if (end == start) throw std::runtime_error("bad number at offset " + std::to_string(pos));
      pos += static_cast<std::size_t>(end - start);
      row.push_back(static_cast<float>(v));  // the stored values are exactly f32
    }
    expect(']');
    rows.push_back(std::move(row));
  }
  expect(']');
  return rows;
}

Expected read_expected(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  Expected e{json_matrix(ss.str(), "inputs"), json_matrix(ss.str(), "outputs")};
  if (e.inputs.empty() || e.inputs.size() != e.outputs.size()) {
    throw std::runtime_error(path + ": inputs and outputs differ in count or are empty");
  }
  for (std::size_t k = 0; k < e.inputs.size(); k++) {
    if (e.inputs[k].size() != e.inputs[0].size() || e.outputs[k].size() != e.outputs[0].size() ||
        e.inputs[k].empty() || e.outputs[k].empty()) {
      throw std::runtime_error(path + ": rows differ in length");
    }
  }
  return e;
}

/// Compare an output with expected output `k`; report and return false on a mismatch.
bool check_output(const Expected& e, std::size_t k, serve::Span<const float> got,
                  const std::string& what) {
  return check_values(got, e.outputs[k], what + " (input " + std::to_string(k) + ")");
}

/// Submit, retrying on BUSY (the admission bound) for up to 60 s.
serve::Submitted submit_retry(const serve::Model& m, const Vec& x, const serve::SubmitOptions& o,
                              std::atomic<unsigned long>& busy) {
  const auto give_up = Clock::now() + 60s;
  for (;;) {
    try {
      return m.submit_with_id(x, o);
    } catch (const serve::Error& e) {
      if (e.code() != SERVE_CODE_BUSY || Clock::now() > give_up) throw;
      busy.fetch_add(1);
      std::this_thread::sleep_for(200us);
    }
  }
}

/* -------------------------------------------------------------------------------------------
 * Phases
 * ----------------------------------------------------------------------------------------- */

void check_options() {
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "RuntimeOptions::backend(\"tpu\")",
               [] { serve::RuntimeOptions().backend("tpu"); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "RuntimeOptions::admission_bound(0)",
               [] { serve::RuntimeOptions().admission_bound(0); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::max_batch(0)",
               [] { serve::ModelOptions().max_batch(0); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::workers(0)",
               [] { serve::ModelOptions().workers(0); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::admission_bound(0)",
               [] { serve::ModelOptions().admission_bound(0); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::max_wait(-1ns)",
               [] { serve::ModelOptions().max_wait(-1ns); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "SubmitOptions::timeout(-1ms)",
               [] { serve::SubmitOptions().timeout(-1ms); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::max_tasks_to_submit(0)",
               [] { serve::ModelOptions().max_tasks_to_submit(0); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::state_slots(0)",
               [] { serve::ModelOptions().state_slots(0); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::policy(7)",
               [] { serve::ModelOptions().policy(static_cast<serve::Policy>(7)); });
  static_assert(static_cast<std::uint32_t>(serve::Policy::automatic) == SERVE_POLICY_AUTO &&
                    static_cast<std::uint32_t>(serve::Policy::timeout) == SERVE_POLICY_TIMEOUT &&
                    static_cast<std::uint32_t>(serve::Policy::cellular) == SERVE_POLICY_CELLULAR &&
                    static_cast<std::uint32_t>(serve::Policy::padding) == SERVE_POLICY_PADDING &&
                    static_cast<std::uint32_t>(serve::Policy::elastic) == SERVE_POLICY_ELASTIC &&
                    static_cast<std::uint32_t>(serve::Policy::adaptive) == SERVE_POLICY_ADAPTIVE,
                "serve::Policy mirrors SERVE_POLICY_*");
  // Unset builders pass NULL (the C defaults); a setter creates the C object.
  serve::SubmitOptions o;
  check(o.get() == nullptr, "a default SubmitOptions allocated a C object");
  o.priority(3);
  check(o.get() != nullptr, "SubmitOptions::priority did not create the C object");
  serve::SubmitOptions moved = std::move(o);
  check(moved.get() != nullptr && o.get() == nullptr, "SubmitOptions move did not transfer");
}

/// 4 threads submitting futures at once; every output is checked.
unsigned long run_concurrent(const serve::Model& model, const Expected& e) {
  constexpr unsigned kThreads = 4, kPerThread = 250;
  serve::SubmitOptions plain, prio, far_deadline;
  prio.priority(5);
  far_deadline.timeout(120s);  // must not fire
  const serve::SubmitOptions* opts[kThreads] = {&plain, &prio, &far_deadline, &prio};
  std::atomic<unsigned long> busy{0}, good{0};
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      try {
        // Even threads keep up to 32 futures outstanding; odd threads wait for each at once.
        const std::size_t window = t % 2 == 0 ? 32 : 1;
        std::vector<std::pair<std::size_t, serve::Submitted>> outstanding;
        auto settle = [&](std::pair<std::size_t, serve::Submitted>& p) {
          if (p.second.result.wait_for(60s) != std::future_status::ready) {
            fail("concurrent request: no completion within 60 s");
            return;
          }
          try {
            Vec y = p.second.result.get();
            if (check_output(e, p.first, y, "concurrent request")) good.fetch_add(1);
          } catch (const serve::Error& err) {
            fail(std::string("concurrent request failed: ") + err.what());
          }
        };
        for (unsigned seq = 0; seq < kPerThread; seq++) {
          std::size_t k = (t + seq) % e.inputs.size();
          serve::Submitted s = submit_retry(model, e.inputs[k], *opts[t], busy);
          outstanding.emplace_back(k, std::move(s));
          if (outstanding.size() >= window) {
            settle(outstanding.front());
            outstanding.erase(outstanding.begin());
          }
        }
        for (auto& p : outstanding) settle(p);
      } catch (const std::exception& ex) {
        fail(std::string("submitter thread: ") + ex.what());
      }
    });
  }
  for (auto& th : threads) th.join();
  check(good.load() == kThreads * kPerThread,
        "concurrent: " + std::to_string(good.load()) + " of " +
            std::to_string(kThreads * kPerThread) + " requests correct");
  say("concurrent: " + std::to_string(good.load()) + " futures fulfilled correctly, " +
      std::to_string(busy.load()) + " BUSY retries");
  return good.load();
}

/// Refused submits throw the right code and leave no completion behind. Returns the number of
/// refusals libserve counts in stats.rejected.
unsigned long run_bad_requests(const serve::Runtime& rt, const serve::Model& model,
                               const Expected& e) {
  const std::size_t n = model.input_len();
  Vec short_input(n - 1, 0.5f), long_input(n + 1, 0.5f);
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit with input one value short",
               [&] { model.submit(short_input); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit with input one value long",
               [&] { model.submit(long_input); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit with an empty input",
               [&] { model.submit(serve::Span<const float>()); });
  serve::SubmitOptions past;
  past.deadline_ns(serve::now_ns() - 1);
  expect_error(SERVE_CODE_DEADLINE_EXCEEDED, "submit with a deadline already passed",
               [&] { model.submit(e.inputs[0], past); });
  serve::Queue q;
  const std::vector<std::uint32_t> tokens{1, 2, 3};
  const std::int32_t parents[] = {-1, 0};
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit_tokens_to an mlp",
               [&] { model.submit_tokens_to(q, 1, tokens); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit_tree_to with 3 tokens and 2 parents",
               [&] { model.submit_tree_to(q, 2, tokens, parents); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "cancel of an id never issued",
               [&] { rt.cancel(UINT64_MAX); });
  // Nothing of the above reached a queue.
  check(q.next(8, 50ms).empty(), "a refused submit produced a completion");
  return 5;  // the wrapper's own tree-length check and cancel are not libserve rejections
}

/// Deadline and cancel on a model that holds requests back 10 s to form a batch.
unsigned long run_deadline_and_cancel(const serve::Runtime& rt, const serve::Model& slow,
                                      const Expected& e) {
  unsigned long cancelled_or_expired = 0;
  {
    serve::SubmitOptions o;
    o.timeout(50ms);
    auto t0 = Clock::now();
    auto f = slow.submit(e.inputs[0], o);
    expect_future_error(f, SERVE_CODE_DEADLINE_EXCEEDED, "request with a 50 ms timeout");
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    check(ms < 5000, "the 50 ms timeout fired after " + std::to_string(ms) + " ms");
    say("deadline: DEADLINE_EXCEEDED after " + std::to_string(ms) + " ms");
    cancelled_or_expired++;
  }
  {
    serve::SubmitOptions o;
    o.deadline_ns(serve::now_ns() + 50'000'000);
    auto f = slow.submit(e.inputs[1], o);
    expect_future_error(f, SERVE_CODE_DEADLINE_EXCEEDED, "request with an absolute deadline");
    cancelled_or_expired++;
  }
  {
    auto t0 = Clock::now();
    serve::Submitted s = slow.submit_with_id(e.inputs[0]);
    rt.cancel(s.id);
    if (s.result.wait_for(60s) != std::future_status::ready) {
      fail("cancelled request: no completion within 60 s");
    } else {
      try {
        Vec y = s.result.get();
        // Only possible if the 10 s batch window closed before the cancel arrived.
        check(Clock::now() - t0 >= 10s, "a cancelled request completed OK within its batch window");
        check_output(e, 0, y, "cancelled request that won the race");
      } catch (const serve::Error& err) {
        check(err.code() == SERVE_CODE_CANCELLED,
              std::string("cancelled request threw ") + err.what());
        cancelled_or_expired++;
      }
    }
    rt.cancel(s.id);  // cancelling a completed request is not an error
    say("cancel: the future reported CANCELLED");
  }
  return cancelled_or_expired;
}

/// The caller-drained queue: tags, batch next(), fd readiness, Completion accessors.
unsigned long run_queue(const serve::Model& model, const Expected& e) {
  serve::Queue q;
  const int fd = q.fd();
  check(fd >= 0, "Queue::fd gave " + std::to_string(fd));
  constexpr unsigned kRequests = 40;
  std::vector<std::uint64_t> ids(kRequests);
  std::vector<unsigned> seen(kRequests, 0);
  for (unsigned i = 0; i < kRequests; i++) {
    ids[i] = model.submit_to(q, 1000 + i, e.inputs[i % e.inputs.size()]);
  }
  pollfd p{fd, POLLIN, 0};
  check(::poll(&p, 1, 60000) == 1 && (p.revents & POLLIN), "the queue fd did not become readable");
  unsigned got = 0;
  const auto give_up = Clock::now() + 60s;
  while (got < kRequests && Clock::now() < give_up) {
    std::vector<serve::Completion> batch = q.next(16, 100ms);
    check(batch.size() <= 16, "Queue::next returned more than max");
    for (serve::Completion& c : batch) {
      const std::uint64_t tag = c.tag();
      if (tag < 1000 || tag >= 1000 + kRequests) {
        fail("queue: unexpected tag " + std::to_string(tag));
        continue;
      }
      const unsigned i = static_cast<unsigned>(tag - 1000);
      seen[i]++;
      check(c.request_id() == ids[i], "queue: completion carries another request id");
      check(c.ok() && c.message() == nullptr, "queue: request failed");
      if (c.ok()) check_output(e, i % e.inputs.size(), c.output_f32(), "queue completion");
      expect_error(SERVE_CODE_INVALID_ARGUMENT, "Completion::output_tokens on f32 output",
                   [&] { c.output_tokens(); });
      serve::Completion moved = std::move(c);
      check(moved.tag() == tag && c.get() == nullptr, "Completion move did not transfer");
      expect_error(SERVE_CODE_INVALID_ARGUMENT, "moved-from Completion", [&] { c.tag(); });
    }
    got += static_cast<unsigned>(batch.size());
  }
  for (unsigned i = 0; i < kRequests; i++) {
    check(seen[i] == 1, "queue: tag " + std::to_string(1000 + i) + " completed " +
                            std::to_string(seen[i]) + " times");
  }
  check(q.next(4, 0ns).empty(), "queue: completions left after draining");
  p.revents = 0;
  check(::poll(&p, 1, 0) == 0, "the queue fd is readable on a drained queue");
  check(q.next(0, 1s).empty(), "Queue::next(max 0) returned completions");
  say("queue: " + std::to_string(got) + " completions drained");
  return got;
}

/* A model handle outlives its runtime; futures resolve when everything is destroyed. */
void run_lifetimes(const std::string& dir, const Expected& e) {
  serve::ModelOptions slow_opts;
  slow_opts.max_batch(64).max_wait(10s);
  {
    serve::Runtime rt(serve::RuntimeOptions().backend("cpu").cpu_threads(1));
    serve::Model m = rt.load_model(dir, slow_opts);
    auto f = m.submit(e.inputs[0]);
    serve::Runtime other = std::move(rt);
    expect_error(SERVE_CODE_INVALID_ARGUMENT, "moved-from Runtime", [&] { rt.stats(); });
    expect_error(SERVE_CODE_INVALID_ARGUMENT, "moved-from Runtime (metrics)",
                 [&] { rt.metrics(); });
    check(rt.get() == nullptr && other.get() != nullptr, "Runtime move did not transfer");
    { serve::Runtime dying = std::move(other); }  // shuts down with no drain
    expect_future_error(f, SERVE_CODE_CANCELLED, "pending future when its Runtime is destroyed");
    expect_error(SERVE_CODE_SHUTDOWN, "submit to a Model whose Runtime is destroyed",
                 [&] { m.submit(e.inputs[0]); });
    serve::Model m2 = std::move(m);
    expect_error(SERVE_CODE_INVALID_ARGUMENT, "moved-from Model", [&] { m.submit(e.inputs[0]); });
    check(std::string(m2.kind()) == "mlp", "moved Model lost its handle");
  }
  std::future<Vec> orphan;
  {
    serve::Runtime rt(serve::RuntimeOptions().backend("cpu").cpu_threads(1));
    serve::Model m = rt.load_model(dir, slow_opts);
    orphan = m.submit(e.inputs[0]);
  }  // Model, then Runtime destroyed with the request pending
  expect_future_error(orphan, SERVE_CODE_CANCELLED, "future outliving its Runtime and Model",
                      5s);
  // Move-assigning over a live Runtime shuts the old one down.
  serve::Runtime a(serve::RuntimeOptions().backend("cpu").cpu_threads(1));
  serve::Model ma = a.load_model(dir, slow_opts);
  auto fa = ma.submit(e.inputs[0]);
  a = serve::Runtime(serve::RuntimeOptions().backend("cpu").cpu_threads(1));
  expect_future_error(fa, SERVE_CODE_CANCELLED, "future of a move-assigned-over Runtime");
  check(std::string(a.backend()) == "cpu", "move-assigned Runtime is not usable");
  say("lifetimes: futures resolve CANCELLED when their runtime goes away");
}

/// Issue 15's fixed-shape policies through the wrapper: elastic (N-Ebird, E-Ebird) and adaptive
/// (serial, two streams), every output checked; bad settings throw INVALID_ARGUMENT.
void run_fixed_policies(const serve::Runtime& rt, const std::string& dir, const Expected& e) {
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::elastic_workers({})",
               [] { serve::ModelOptions().elastic_workers({}); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::streams(3)",
               [] { serve::ModelOptions().streams(3); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::latency_bound(0ns)",
               [] { serve::ModelOptions().latency_bound(0ns); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "ModelOptions::add_engine_config(8, {4, 2})",
               [] { serve::ModelOptions().add_engine_config(8, {4, 2}); });
  const char* names[] = {"nebird", "eebird", "adaptive-serial", "adaptive"};
  for (int which = 0; which < 4; which++) {
    serve::ModelOptions o;
    if (which == 0) {
      o.policy(serve::Policy::elastic).elastic_workers({1, 2, 4}).max_inflight(4).ring_slots(64);
    } else if (which == 1) {
      o.policy(serve::Policy::elastic).add_engine_config(4, {2, 2}).add_engine_config(8, {4, 4});
      o.max_inflight(8);
    } else {
      o.policy(serve::Policy::adaptive).latency_bound(20ms).streams(which == 2 ? 1 : 2).max_batch(8);
    }
    serve::Model m = rt.load_model(dir, o);
    std::vector<std::pair<std::size_t, serve::Submitted>> out;
    for (std::size_t i = 0; i < 40; i++) {
      const std::size_t k = i % e.inputs.size();
      out.emplace_back(k, m.submit_with_id(e.inputs[k]));
    }
    for (auto& p : out) {
      try {
        Vec y = p.second.result.get();
        check_output(e, p.first, y, names[which]);
      } catch (const serve::Error& err) {
        fail(std::string(names[which]) + ": " + err.what());
      }
    }
  }
}

/// The tenant mode through the wrapper: two copies of the mlp sharing the cores under VELTAIR,
/// every output checked; a bad scheme, an empty group and a plain model's tenant profile throw
/// INVALID_ARGUMENT.
void run_tenants(const serve::Runtime& rt, const serve::Model& plain, const std::string& dir,
                 const Expected& e) {
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "Tenants::scheme(\"fastest\")",
               [] { serve::Tenants().scheme("fastest"); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "Tenants::add_model(qos 0)",
               [&] { serve::Tenants().add_model(dir, "zero", 0ns); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "add_tenants(an empty group)",
               [&] { rt.add_tenants(serve::Tenants()); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tenant_feasible() of a plain model",
               [&] { plain.tenant_feasible(); });
  serve::Tenants group;
  group.scheme("veltair").levels(3, 0.5).add_model(dir, "tenant-a", 100ms).add_model(dir, "", 200ms);
  check(group.size() == 2, "Tenants::size() is " + std::to_string(group.size()));
  std::vector<serve::Model> tenants = rt.add_tenants(group);
  check(tenants.size() == 2, std::to_string(tenants.size()) + " tenant models");
  for (const serve::Model& t : tenants) {
    check(t.tenant_feasible(), "a tenant mlp flagged infeasible at 100 ms");
    check(t.tenant_solo() > 0ns && t.tenant_solo() < 100ms, "tenant solo time out of range");
  }
  std::vector<std::pair<std::size_t, std::future<Vec>>> out;
  for (std::size_t i = 0; i < 60; i++) {
    const std::size_t k = i % e.inputs.size();
    out.emplace_back(k, tenants[i % 2].submit(e.inputs[k]));
  }
  for (auto& p : out) {
    try {
      check_output(e, p.first, p.second.get(), "tenant");
    } catch (const serve::Error& err) {
      fail(std::string("tenant: ") + err.what());
    }
  }
  say("tenants: 2 mlp tenants served 60 requests");
}

int run(const std::string& dir) {
  // Version: the header compiled against must match the linked library.
  const std::string want = std::to_string(SERVE_VERSION_MAJOR) + "." +
                           std::to_string(SERVE_VERSION_MINOR) + "." +
                           std::to_string(SERVE_VERSION_PATCH);
  if (want != serve::version()) {
    fail(std::string("serve::version() = ") + serve::version() + " but the header says " + want);
    return 1;
  }
  check(std::string(include_twice_busy_name()) == "BUSY", "include_twice.cpp: code name");
  check(include_twice_unset_options_are_null() == 3, "include_twice.cpp: options");
  check(std::string(serve_code_name(9999)) == "UNKNOWN", "serve_code_name(9999)");
  serve::Error err(SERVE_CODE_BUSY, "try later");
  check(std::string(err.what()) == "BUSY: try later" && std::string(err.message()) == "try later",
        "serve::Error formatting");

  const Expected e = read_expected(dir + "/expected.json");
  check_options();

  serve::Runtime rt(serve::RuntimeOptions().backend("cpu").cpu_threads(2).admission_bound(64));
  check(std::string(rt.backend()) == "cpu", std::string("backend is ") + rt.backend());
  expect_error(SERVE_CODE_NOT_FOUND, "load_model(missing directory)",
               [&] { rt.load_model(dir + "/does-not-exist"); });
  serve::Model model =
      rt.load_model(dir, serve::ModelOptions().name("cpp-mlp").max_batch(16).workers(2).max_wait(
                             200us));
  serve::Model slow = rt.load_model(
      dir,
      serve::ModelOptions().name("cpp-mlp-slow").max_batch(64).max_wait(10s).admission_bound(1000));
  check(std::string(model.kind()) == "mlp", std::string("model kind is ") + model.kind());
  if (model.input_len() != e.inputs[0].size() || model.output_len() != e.outputs[0].size()) {
    fail("model shape " + std::to_string(model.input_len()) + " -> " +
         std::to_string(model.output_len()) + " does not match expected.json");
    return 1;
  }

  unsigned long good = run_concurrent(model, e);
  unsigned long rejects = run_bad_requests(rt, model, e);
  unsigned long expired = run_deadline_and_cancel(rt, slow, e);
  good += run_queue(model, e);
  run_fixed_policies(rt, dir, e);
  run_tenants(rt, model, dir, e);

  {
    serve::Stats st = rt.stats();
    say("stats: submitted " + std::to_string(st.submitted()) + ", completed " +
        std::to_string(st.completed_total()) + " (OK " +
        std::to_string(st.completed(SERVE_CODE_OK)) + "), rejected " +
        std::to_string(st.rejected()) + ", tasks " + std::to_string(st.tasks_launched()));
    check(st.completed_total() == st.submitted(), "stats: completed_total != submitted");
    check(st.completed(SERVE_CODE_OK) >= good, "stats: fewer OK completions than good requests");
    check(st.completed(SERVE_CODE_CANCELLED) + st.completed(SERVE_CODE_DEADLINE_EXCEEDED) >=
              expired,
          "stats: fewer CANCELLED/DEADLINE_EXCEEDED than seen");
    check(st.rejected() >= rejects, "stats: fewer rejections than refused submits");
    check(st.in_flight() == 0, "stats: " + std::to_string(st.in_flight()) +
                                   " requests in flight after every future resolved");
    // queued/running are gauges the engine publishes just after delivering completions, so they
    // may lag the last delivery briefly; they must settle at 0.
    const auto settle_by = Clock::now() + 5s;
    serve::Stats g = rt.stats();
    while ((g.queued() != 0 || g.running() != 0) && Clock::now() < settle_by) {
      std::this_thread::sleep_for(1ms);
      g = rt.stats();
    }
    check(g.queued() == 0 && g.running() == 0,
          "stats: queued " + std::to_string(g.queued()) + ", running " +
              std::to_string(g.running()) + " 5 s after every future resolved");
    check(st.tasks_launched() >= 1 && st.batched_requests() >= st.completed(SERVE_CODE_OK),
          "stats: task counters inconsistent");
  }
  {
    // Metrics: OpenMetrics text with the model's completed-OK counter, ending with # EOF.
    const std::string text = rt.metrics();
    const std::string sample = "\nserve_requests_completed_total{model=\"cpp-mlp\",code=\"OK\"} ";
    const std::size_t at = text.find(sample);
    const double ok = at == std::string::npos ? -1 : std::stod(text.substr(at + sample.size()));
    check(ok >= static_cast<double>(good),
          "metrics: completed OK of cpp-mlp is " + std::to_string(ok) + ", want at least " +
              std::to_string(good));
    const std::string eof = "\n# EOF\n";
    check(text.size() >= eof.size() && text.compare(text.size() - eof.size(), eof.size(), eof) == 0,
          "metrics: the text does not end with # EOF");
  }

  // Shutdown with requests pending: every future resolves (CANCELLED, or OK if drained).
  std::vector<std::future<Vec>> pending;
  for (int i = 0; i < 5; i++) pending.push_back(slow.submit(e.inputs[0]));
  rt.shutdown(100ms);
  rt.shutdown();  // idempotent
  for (auto& f : pending) {
    if (f.wait_for(10s) != std::future_status::ready) {
      fail("a pending future did not resolve after shutdown");
      continue;
    }
    try {
      check_output(e, 0, f.get(), "request drained by shutdown");
    } catch (const serve::Error& ex) {
      check(ex.code() == SERVE_CODE_CANCELLED, std::string("pending request at shutdown: ") +
                                                   ex.what());
    }
  }
  expect_error(SERVE_CODE_SHUTDOWN, "submit after shutdown", [&] { model.submit(e.inputs[0]); });
  expect_error(SERVE_CODE_SHUTDOWN, "load_model after shutdown", [&] { rt.load_model(dir); });
  {
    serve::Stats st = rt.stats();
    check(st.completed_total() == st.submitted(), "stats after shutdown: not all completed");
  }
  say("shutdown: pending futures resolved, later submits refused");

  run_lifetimes(dir, e);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 1 && argc != 2 && argc != 6) {
    std::cerr << "usage: " << argv[0]
              << " [MODEL_DIR [LSTM_DIR TREELSTM_DIR SEQ2SEQ_DIR RECURRENT_FILE]]\n";
    return 2;
  }
  const std::string dir = argc >= 2 ? argv[1] : "ffi_examples/testdata/mlp_4_8_3";
  int rc = 1;
  try {
    rc = run(dir);
    if (rc == 0 && argc == 6) {
      run_recurrent(dir, argv[2], argv[3], argv[4], argv[5]);
    } else if (rc == 0) {
      say("recurrent models: skipped (no LSTM_DIR TREELSTM_DIR SEQ2SEQ_DIR RECURRENT_FILE)");
    }
  } catch (const std::exception& ex) {
    fail(std::string("unexpected exception: ") + ex.what());
  }
  const int failures = g_failures.load();
  if (rc != 0 || failures != 0) {
    std::cout << "example.cpp: " << failures << " check(s) failed" << std::endl;
    return 1;
  }
  std::cout << "example.cpp: all checks passed" << std::endl;
  return 0;
}
