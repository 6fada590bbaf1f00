// custom_model.cpp: a C++ engine under libserve's batching through the C ABI
// (serve_runtime_add_custom_model; ARCHITECTURE.md §6). Built and run by tests/custom_native.rs
// (under AddressSanitizer + UBSan with SERVE_CPP_SANITIZE=1).
//
// The engine is a C++ object owned by libserve once registered (`new` here, `delete` in the free
// callback); the execute callback is a captureless lambda. Two workers run calls concurrently,
// so the engine guards its statistics with a mutex. A batch holding a row whose first input is
// negative fails with code 3 and a message. Checks: outputs, BACKEND with the engine's message,
// exactly-once completion, concurrent calls on two workers, and the engine deleted exactly once,
// after the model is freed.
#include "libserve.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr size_t kIn = 8;
constexpr size_t kOut = 2;
constexpr int kRequests = 300;

std::atomic<int> g_failures{0};
std::atomic<int> g_deleted{0};

void fail(const std::string &what) {
  std::printf("FAIL: %s\n", what.c_str());
  g_failures++;
}

bool ok(serve_error *err, const char *what) {
  if (err == nullptr) return true;
  fail(std::string(what) + ": " + serve_error_message(err));
  serve_error_free(err);
  return false;
}

class Engine {
 public:
  ~Engine() { g_deleted++; }

  // y = [sum(x), max(x)] per row; throws nothing.
  int32_t Run(const serve_custom_call &call) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      workers_.insert(call.worker);
      calls_++;
    }
    for (size_t r = 0; r < call.batch; r++) {
      const float *x = call.input + r * call.input_stride;
      if (x[0] < 0.0f) {
        std::snprintf(call.message, call.message_capacity, "row %zu starts with %g", r, x[0]);
        return 3;
      }
      float sum = 0.0f, max = x[0];
      for (size_t i = 0; i < call.input_stride; i++) {
        sum += x[i];
        if (x[i] > max) max = x[i];
      }
      float *y = call.output + r * call.output_stride;
      y[0] = sum;
      y[1] = max;
    }
    return 0;
  }

  size_t Workers() {
    std::lock_guard<std::mutex> lock(mu_);
    return workers_.size();
  }

 private:
  std::mutex mu_;
  std::set<size_t> workers_;
  int calls_ = 0;
};

}  // namespace

int main() {
  serve_runtime_options *ro = nullptr;
  serve_runtime *rt = nullptr;
  if (!ok(serve_runtime_options_new(&ro), "runtime options") ||
      !ok(serve_runtime_options_set_backend(ro, "cpu"), "backend") ||
      !ok(serve_runtime_new(ro, &rt), "runtime")) {
    return 1;
  }
  serve_runtime_options_free(ro);

  auto engine = std::make_unique<Engine>();
  Engine *raw = engine.get();
  serve_custom_model_options *co = nullptr;
  serve_custom_execute_fn execute = [](void *user, const serve_custom_call *call) -> int32_t {
    return static_cast<Engine *>(user)->Run(*call);
  };
  serve_custom_free_fn destroy = [](void *user) { delete static_cast<Engine *>(user); };
  if (!ok(serve_custom_model_options_new(kIn, kOut, execute, raw, destroy, &co), "custom options")) return 1;
  engine.release();  // libserve owns it now: `destroy` deletes it

  serve_model_options *mo = nullptr;
  serve_model *model = nullptr;
  if (!ok(serve_model_options_new(&mo), "model options") ||
      !ok(serve_model_options_set_workers(mo, 2), "workers") ||
      !ok(serve_model_options_set_max_batch(mo, 8), "max batch") ||
      !ok(serve_runtime_add_custom_model(rt, "stats", co, mo, &model), "add custom model")) {
    return 1;
  }
  serve_model_options_free(mo);
  serve_custom_model_options_free(co);

  serve_queue *q = nullptr;
  if (!ok(serve_queue_new(&q), "queue")) return 1;
  std::vector<std::vector<float>> inputs;
  for (int k = 0; k < kRequests; k++) {
    std::vector<float> x(kIn);
    for (size_t i = 0; i < kIn; i++) x[i] = static_cast<float>((k * 5 + static_cast<int>(i) * 3) % 13);
    if (k % 37 == 36) x[0] = -2.0f;
    inputs.push_back(x);
    if (!ok(serve_submit_f32(model, q, static_cast<uint64_t>(k), x.data(), kIn, nullptr, nullptr), "submit")) return 1;
  }
  std::vector<int> seen(kRequests, 0);
  int done = 0, failed = 0;
  while (done < kRequests) {
    serve_completion *cs[16];
    size_t n = 0;
    if (!ok(serve_queue_next(q, cs, 16, 10'000'000'000ull, &n), "queue next") || n == 0) {
      fail("completions stopped");
      return 1;
    }
    for (size_t c = 0; c < n; c++) {
      const auto k = serve_completion_tag(cs[c]);
      seen[k]++;
      const auto &x = inputs[k];
      if (serve_completion_code(cs[c]) == SERVE_CODE_OK) {
        const float *y = nullptr;
        size_t len = 0;
        if (ok(serve_completion_output_f32(cs[c], &y, &len), "output")) {
          float sum = 0.0f, max = x[0];
          for (float v : x) {
            sum += v;
            if (v > max) max = v;
          }
          if (len != kOut || y[0] != sum || y[1] != max) {
            fail("request " + std::to_string(k) + ": output (" + std::to_string(y[0]) + ", " + std::to_string(y[1]) + "), want (" + std::to_string(sum) + ", " + std::to_string(max) + ")");
          }
          if (x[0] < 0.0f) fail("request " + std::to_string(k) + " should have failed");
        }
      } else {
        failed++;
        const char *m = serve_completion_message(cs[c]);
        if (serve_completion_code(cs[c]) != SERVE_CODE_BACKEND || m == nullptr ||
            std::strstr(m, "execute returned 3: row ") == nullptr) {
          fail("request " + std::to_string(k) + ": " + (m ? m : "(no message)"));
        }
      }
      serve_completion_free(cs[c]);
      done++;
    }
  }
  for (int k = 0; k < kRequests; k++) {
    if (seen[k] != 1) fail("request " + std::to_string(k) + " completed " + std::to_string(seen[k]) + " times");
  }
  if (failed < kRequests / 37) fail("only " + std::to_string(failed) + " requests failed");
  const size_t workers = raw->Workers();
  if (workers != 2) fail("calls came from " + std::to_string(workers) + " worker(s), not 2");
  if (g_deleted != 0) fail("the engine was deleted while its model lives");

  serve_model_free(model);
  serve_queue_free(q);
  serve_runtime_free(rt);
  if (g_deleted != 1) fail("the engine was deleted " + std::to_string(g_deleted.load()) + " times");
  if (g_failures != 0) {
    std::printf("custom_model.cpp: %d check(s) FAILED\n", g_failures.load());
    return 1;
  }
  std::printf("custom_model.cpp: all checks passed\n");
  return 0;
}
