/*
 * example_check.hpp — the check helpers of the C++ example programs (example.cpp and
 * example_recurrent.cpp): failures are counted and printed as `FAIL: ...`, and a program passes
 * only when g_failures stays 0.
 */
#ifndef SERVE_EXAMPLE_CHECK_HPP
#define SERVE_EXAMPLE_CHECK_HPP

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "serve.hpp"

namespace example {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Vec = std::vector<float>;

/* -------------------------------------------------------------------------------------------
 * Check helpers
 * ----------------------------------------------------------------------------------------- */

inline std::atomic<int> g_failures{0};
inline std::mutex g_out;

inline void fail(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(g_out);
    std::cout << "FAIL: " << what << std::endl;
  }
  g_failures.fetch_add(1);
}

inline void check(bool cond, const std::string& what) {
  if (!cond) fail(what);
}

inline void say(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_out);
  std::cout << line << std::endl;
}

/// Run `f`, which must throw serve::Error with code `want` and a non-empty message.
template <class F>
void expect_error(serve::Code want, const std::string& what, F&& f) {
  try {
    f();
    fail(what + ": succeeded, expected " + serve::code_name(want));
  } catch (const serve::Error& e) {
    if (e.code() != want) {
      fail(what + ": threw " + e.what() + ", expected " + serve::code_name(want));
    } else if (e.message()[0] == '\0') {
      fail(what + ": error " + serve::code_name(want) + " has an empty message");
    } else if (std::string(e.what()).rfind(std::string(serve::code_name(want)) + ": ", 0) != 0) {
      fail(what + ": what() `" + e.what() + "` does not start with the code name");
    }
  } catch (const std::exception& e) {
    fail(what + ": threw a non-serve exception: " + e.what());
  }
}

/// Wait for `f` (at most `limit`) and expect it to throw serve::Error with `want`.
template <class T>
void expect_future_error(std::future<T>& f, serve::Code want, const std::string& what,
                         std::chrono::seconds limit = 60s) {
  if (f.wait_for(limit) != std::future_status::ready) {
    fail(what + ": no completion within the time limit");
    return;
  }
  expect_error(want, what, [&] { f.get(); });
}

/// Compare an output with `want` (relative tolerance 1e-4, absolute below magnitude 1); report
/// and return false on a mismatch.
inline bool check_values(serve::Span<const float> got, const Vec& want, const std::string& what) {
  if (got.size() != want.size()) {
    fail(what + ": output has " + std::to_string(got.size()) + " values, expected " +
         std::to_string(want.size()));
    return false;
  }
  for (std::size_t j = 0; j < want.size(); j++) {
    float tol = 1e-4f * std::max(1.0f, std::fabs(want[j]));
    if (!(std::fabs(got[j] - want[j]) <= tol)) {
      fail(what + ": output[" + std::to_string(j) + "] = " + std::to_string(got[j]) +
           ", expected " + std::to_string(want[j]));
      return false;
    }
  }
  return true;
}

/// The recurrent phase (example_recurrent.cpp): lstm, treelstm and seq2seq requests under the
/// cellular and padding policies, checked against RECURRENT_FILE.
void run_recurrent(const std::string& mlp_dir, const std::string& lstm_dir, const std::string& tree_dir,
                   const std::string& s2s_dir, const std::string& file);

}  // namespace example

#endif  // SERVE_EXAMPLE_CHECK_HPP
