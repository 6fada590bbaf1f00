/*
 * include_twice.cpp — a second translation unit linked into example.cpp's program. It includes
 * libserve.h and serve.hpp twice each, in both orders, so a missing include guard fails to
 * compile (redefinitions), and, being a second TU that includes serve.hpp, it makes a non-inline
 * definition in the header-only wrapper fail to link (multiple definitions). It also proves that
 * libserve.h declares its functions extern "C" for C++: the calls below would otherwise look for
 * mangled names and fail to link.
 */

#include "libserve.h"
#include "serve.hpp"
#include "libserve.h"
#include "serve.hpp"

#include <cstdint>

#ifndef LIBSERVE_H
#error "libserve.h include guard macro LIBSERVE_H is not defined"
#endif
#ifndef SERVE_HPP
#error "serve.hpp include guard macro SERVE_HPP is not defined"
#endif

/// "BUSY", through both the C function and the wrapper.
const char* include_twice_busy_name() {
  const char* c = serve_code_name(static_cast<std::uint32_t>(SERVE_CODE_BUSY));
  return c == serve::code_name(SERVE_CODE_BUSY) ? c : "mismatch";
}

/// 3 when unset option builders pass NULL and set ones a C object, as serve.hpp documents.
std::uint64_t include_twice_unset_options_are_null() {
  serve::RuntimeOptions r;
  serve::ModelOptions m;
  serve::SubmitOptions s;
  std::uint64_t score = 0;
  score += r.get() == nullptr;
  score += m.get() == nullptr;
  s.timeout(std::chrono::milliseconds(5));
  score += s.get() != nullptr;
  return score;
}
