/*
 * example_recurrent.cpp — the recurrent phase of the C++ example (example.cpp runs it when given
 * the recurrent fixtures): lstm (submit_tokens), treelstm (submit_tree) and seq2seq
 * (submit_decode) requests under the cellular and the padding policy, from 4 threads at once and
 * through a caller-drained Queue, every output checked (f32 within the tolerance of
 * check_values, tokens exactly); malformed sequences and trees refused with INVALID_ARGUMENT; a
 * policy that does not fit the kind refused with UNSUPPORTED and an option the policy lacks with
 * INVALID_ARGUMENT; cancel by request id.
 */

#include <cstdint>
#include <fstream>
#include <istream>
#include <stdexcept>
#include <thread>

#include "example_check.hpp"

namespace example {
namespace {

/* -------------------------------------------------------------------------------------------
 * Recurrent models: lstm, treelstm, seq2seq
 * ----------------------------------------------------------------------------------------- */

struct RecurrentCase {
  std::vector<std::uint32_t> tokens;
  std::vector<std::int32_t> parents;  // treelstm only
  Vec output;                         // lstm, treelstm
  std::vector<std::uint32_t> output_tokens;  // seq2seq
};

struct RecurrentCases {
  std::vector<RecurrentCase> lstm, tree, seq2seq;
};

/// One `LABEL K` section of RECURRENT_FILE (format at the top).
std::vector<RecurrentCase> read_section(std::istream& in, const std::string& label, bool tree,
                                        bool token_output) {
  std::string got;
  std::size_t k = 0;
  if (!(in >> got >> k) || got != label || k == 0) {
    throw std::runtime_error("recurrent file: expected `" + label + " K`");
  }
  auto count = [&](const char* what) {
    std::size_t n = 0;
    if (!(in >> n) || n == 0 || n > 100000) {
      throw std::runtime_error("recurrent file: bad " + std::string(what) + " in " + label);
    }
    return n;
  };
  auto integer = [&]() {
    long long v = 0;
    if (!(in >> v)) throw std::runtime_error("recurrent file: bad integer in " + label);
    return v;
  };
  std::vector<RecurrentCase> cases(k);
  for (RecurrentCase& c : cases) {
    const std::size_t n = count("length");
    for (std::size_t i = 0; i < n; i++) c.tokens.push_back(static_cast<std::uint32_t>(integer()));
    if (tree) {
      for (std::size_t i = 0; i < n; i++) c.parents.push_back(static_cast<std::int32_t>(integer()));
    }
    const std::size_t m = count("output length");
    for (std::size_t i = 0; i < m; i++) {
      if (token_output) {
        c.output_tokens.push_back(static_cast<std::uint32_t>(integer()));
      } else {
        double v = 0;
        if (!(in >> v)) throw std::runtime_error("recurrent file: bad value in " + label);
        c.output.push_back(static_cast<float>(v));  // the stored values are exactly f32
      }
    }
  }
  return cases;
}

RecurrentCases read_recurrent(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  RecurrentCases r;
  r.lstm = read_section(in, "LSTM", false, false);
  r.tree = read_section(in, "TREE", true, false);
  r.seq2seq = read_section(in, "SEQ2SEQ", false, true);
  return r;
}

/// Compare a token output exactly; report and return false on a mismatch.
bool check_tokens(serve::Span<const std::uint32_t> got, const std::vector<std::uint32_t>& want,
                  const std::string& what) {
  if (got.size() == want.size() && std::equal(want.begin(), want.end(), got.begin())) return true;
  std::string g, w;
  for (std::uint32_t t : got) g += " " + std::to_string(t);
  for (std::uint32_t t : want) w += " " + std::to_string(t);
  fail(what + ": tokens [" + g + " ] expected [" + w + " ]");
  return false;
}

/// Wait for an f32 future and compare it; count it in `good` when right.
void settle_f32(std::future<Vec>& f, const Vec& want, const std::string& what,
                std::atomic<unsigned long>& good) {
  if (f.wait_for(60s) != std::future_status::ready) {
    fail(what + ": no completion within 60 s");
    return;
  }
  try {
    if (check_values(f.get(), want, what)) good.fetch_add(1);
  } catch (const serve::Error& err) {
    fail(what + ": " + err.what());
  }
}

/// The three recurrent models loaded under one policy, every fixture request submitted from 4
/// threads at once (futures), then once more through a caller-drained queue. Returns the number
/// of correct outputs.
unsigned long run_recurrent_policy(const serve::Runtime& rt, const std::string& name,
                                   const serve::ModelOptions& opts, const std::string& lstm_dir,
                                   const std::string& tree_dir, const std::string& s2s_dir,
                                   const RecurrentCases& cases) {
  serve::Model lstm = rt.load_model(lstm_dir, opts);
  serve::Model tree = rt.load_model(tree_dir, opts);
  serve::Model s2s = rt.load_model(s2s_dir, opts);
  check(std::string(lstm.kind()) == "lstm" && std::string(tree.kind()) == "treelstm" &&
            std::string(s2s.kind()) == "seq2seq",
        name + ": model kinds " + lstm.kind() + ", " + tree.kind() + ", " + s2s.kind());
  check(lstm.input_len() == 0 && lstm.output_len() == cases.lstm[0].output.size() &&
            tree.output_len() == cases.tree[0].output.size() && s2s.output_len() == 0,
        name + ": model shapes do not match the expected outputs");

  constexpr unsigned kThreads = 4;
  std::atomic<unsigned long> good{0};
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      try {
        serve::SubmitOptions o;
        o.priority(static_cast<std::int32_t>(t % 2));
        std::vector<std::future<Vec>> lf, tf;
        std::vector<std::future<std::vector<std::uint32_t>>> sf;
        // Everything in flight at once, in a different order on each thread.
        for (std::size_t i = 0; i < cases.lstm.size(); i++) {
          const std::size_t k = (i + t) % cases.lstm.size();
          lf.push_back(lstm.submit_tokens(cases.lstm[k].tokens, o));
        }
        for (std::size_t i = 0; i < cases.tree.size(); i++) {
          const std::size_t k = (i + t) % cases.tree.size();
          tf.push_back(tree.submit_tree(cases.tree[k].tokens, cases.tree[k].parents, o));
        }
        for (std::size_t i = 0; i < cases.seq2seq.size(); i++) {
          const std::size_t k = (i + t) % cases.seq2seq.size();
          sf.push_back(s2s.submit_decode(cases.seq2seq[k].tokens, o));
        }
        for (std::size_t i = 0; i < lf.size(); i++) {
          const std::size_t k = (i + t) % cases.lstm.size();
          settle_f32(lf[i], cases.lstm[k].output, name + " lstm request " + std::to_string(k), good);
        }
        for (std::size_t i = 0; i < tf.size(); i++) {
          const std::size_t k = (i + t) % cases.tree.size();
          settle_f32(tf[i], cases.tree[k].output, name + " tree request " + std::to_string(k), good);
        }
        for (std::size_t i = 0; i < sf.size(); i++) {
          const std::size_t k = (i + t) % cases.seq2seq.size();
          const std::string what = name + " seq2seq request " + std::to_string(k);
          if (sf[i].wait_for(60s) != std::future_status::ready) {
            fail(what + ": no completion within 60 s");
            continue;
          }
          try {
            if (check_tokens(sf[i].get(), cases.seq2seq[k].output_tokens, what)) good.fetch_add(1);
          } catch (const serve::Error& err) {
            fail(what + ": " + err.what());
          }
        }
      } catch (const std::exception& ex) {
        fail(name + " submitter thread: " + ex.what());
      }
    });
  }
  for (auto& th : threads) th.join();
  const std::size_t per_thread = cases.lstm.size() + cases.tree.size() + cases.seq2seq.size();
  check(good.load() == kThreads * per_thread,
        name + ": " + std::to_string(good.load()) + " of " +
            std::to_string(kThreads * per_thread) + " recurrent futures correct");

  // The caller-drained queue: tag = section * 1000 + case.
  serve::Queue q;
  std::size_t submitted = 0;
  for (std::size_t k = 0; k < cases.lstm.size(); k++, submitted++) {
    lstm.submit_tokens_to(q, k, cases.lstm[k].tokens);
  }
  for (std::size_t k = 0; k < cases.tree.size(); k++, submitted++) {
    tree.submit_tree_to(q, 1000 + k, cases.tree[k].tokens, cases.tree[k].parents);
  }
  for (std::size_t k = 0; k < cases.seq2seq.size(); k++, submitted++) {
    s2s.submit_tokens_to(q, 2000 + k, cases.seq2seq[k].tokens);
  }
  std::size_t drained = 0;
  const auto give_up = Clock::now() + 60s;
  while (drained < submitted && Clock::now() < give_up) {
    for (serve::Completion& c : q.next(8, 100ms)) {
      drained++;
      const std::uint64_t tag = c.tag();
      const std::size_t section = static_cast<std::size_t>(tag / 1000), k = tag % 1000;
      const std::string what = name + " queue completion " + std::to_string(tag);
      if (!c.ok()) {
        fail(what + ": failed: " + (c.message() ? c.message() : "(no message)"));
        continue;
      }
      if (section == 0 && k < cases.lstm.size()) {
        if (check_values(c.output_f32(), cases.lstm[k].output, what)) good.fetch_add(1);
      } else if (section == 1 && k < cases.tree.size()) {
        if (check_values(c.output_f32(), cases.tree[k].output, what)) good.fetch_add(1);
      } else if (section == 2 && k < cases.seq2seq.size()) {
        if (check_tokens(c.output_tokens(), cases.seq2seq[k].output_tokens, what)) {
          good.fetch_add(1);
        }
        expect_error(SERVE_CODE_INVALID_ARGUMENT, "Completion::output_f32 on a token output",
                     [&] { c.output_f32(); });
      } else {
        fail(what + ": unexpected tag");
      }
    }
  }
  check(drained == submitted, name + ": drained " + std::to_string(drained) + " of " +
                                  std::to_string(submitted) + " queue completions");
  say("recurrent " + name + ": " + std::to_string(good.load()) + " outputs correct (" +
      std::to_string(kThreads * per_thread) + " futures from " + std::to_string(kThreads) +
      " threads, " + std::to_string(submitted) + " through a queue)");
  return good.load();
}

/// Refused recurrent requests, options that do not fit, and cancel by id.
void run_recurrent_errors(const serve::Runtime& rt, const std::string& mlp_dir,
                          const std::string& lstm_dir, const std::string& tree_dir,
                          const std::string& s2s_dir, const RecurrentCases& cases) {
  // Policies and options that do not fit the kind.
  expect_error(SERVE_CODE_UNSUPPORTED, "lstm under the timeout policy", [&] {
    rt.load_model(lstm_dir, serve::ModelOptions().policy(serve::Policy::timeout));
  });
  expect_error(SERVE_CODE_UNSUPPORTED, "treelstm under the timeout policy", [&] {
    rt.load_model(tree_dir, serve::ModelOptions().policy(serve::Policy::timeout));
  });
  expect_error(SERVE_CODE_UNSUPPORTED, "mlp under the cellular policy", [&] {
    rt.load_model(mlp_dir, serve::ModelOptions().policy(serve::Policy::cellular));
  });
  expect_error(SERVE_CODE_UNSUPPORTED, "mlp under the padding policy", [&] {
    rt.load_model(mlp_dir, serve::ModelOptions().policy(serve::Policy::padding));
  });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "max_wait under the cellular policy", [&] {
    rt.load_model(lstm_dir, serve::ModelOptions().policy(serve::Policy::cellular).max_wait(1ms));
  });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "pad_to_max under the padding policy", [&] {
    rt.load_model(s2s_dir, serve::ModelOptions().policy(serve::Policy::padding).pad_to_max(true));
  });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "max_tasks_to_submit under the timeout policy",
               [&] { rt.load_model(mlp_dir, serve::ModelOptions().max_tasks_to_submit(2)); });

  serve::Model lstm = rt.load_model(lstm_dir);  // the kind's own policy: cellular
  serve::Model tree = rt.load_model(tree_dir, serve::ModelOptions().state_slots(8));
  // Padding, and the layers unfolded (no token-gate tables).
  serve::Model s2s = rt.load_model(
      s2s_dir, serve::ModelOptions().policy(serve::Policy::padding).token_gates_bytes(0));
  const std::vector<std::uint32_t> huge_token{1, 1u << 30}, no_tokens;
  const std::uint32_t two[] = {1, 2}, three[] = {1, 2, 3};
  const std::int32_t two_roots[] = {-1, 0, -1}, cycle[] = {-1, 2, 1}, out_of_range[] = {-1, 3, 0},
                     self_parent[] = {-1, 1}, chain[] = {-1, 0};
  // Refused by libserve (counted in stats.rejected).
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "lstm token outside the vocabulary",
               [&] { lstm.submit_tokens(huge_token); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "lstm empty sequence",
               [&] { lstm.submit_tokens(no_tokens); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "seq2seq token outside the vocabulary",
               [&] { s2s.submit_decode(huge_token); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tree with two roots",
               [&] { tree.submit_tree(three, two_roots); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tree with a cycle",
               [&] { tree.submit_tree(three, cycle); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tree with a parent out of range",
               [&] { tree.submit_tree(three, out_of_range); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tree with a node its own parent",
               [&] { tree.submit_tree(two, self_parent); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tree token outside the vocabulary", [&] {
    tree.submit_tree(huge_token, serve::Span<const std::int32_t>(chain));
  });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tokens to a treelstm",
               [&] { tree.submit_tokens(two); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "tree to an lstm",
               [&] { lstm.submit_tree(two, chain); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "f32 input to an lstm",
               [&] { lstm.submit(Vec{1.0f, 2.0f}); });
  // A tree needing more state slots than the model has (8) is refused.
  const RecurrentCase* big = nullptr;
  for (const RecurrentCase& c : cases.tree) {
    if (c.tokens.size() > 8) big = &c;
  }
  if (big != nullptr) {
    expect_error(SERVE_CODE_INVALID_ARGUMENT, "tree larger than the state slots",
                 [&] { tree.submit_tree(big->tokens, big->parents); });
  }
  // Refused by the wrapper, before libserve: the output type and the tree's lengths.
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit_tokens to a seq2seq (token output)",
               [&] { s2s.submit_tokens(two); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit_decode to an lstm (f32 output)",
               [&] { lstm.submit_decode(two); });
  expect_error(SERVE_CODE_INVALID_ARGUMENT, "submit_tree with 3 tokens and 2 parents",
               [&] { tree.submit_tree(three, chain); });

  // Cancel by id: the future reports CANCELLED, or the output if the request won the race.
  std::atomic<unsigned long> good{0};
  const RecurrentCase& longest = *std::max_element(
      cases.lstm.begin(), cases.lstm.end(),
      [](const RecurrentCase& a, const RecurrentCase& b) { return a.tokens.size() < b.tokens.size(); });
  serve::Submitted s = lstm.submit_tokens_with_id(longest.tokens);
  rt.cancel(s.id);
  if (s.result.wait_for(60s) != std::future_status::ready) {
    fail("cancelled lstm request: no completion within 60 s");
  } else {
    try {
      check_values(s.result.get(), longest.output, "cancelled lstm request that won the race");
    } catch (const serve::Error& err) {
      check(err.code() == SERVE_CODE_CANCELLED, std::string("cancelled lstm request threw ") +
                                                    err.what());
    }
  }
  serve::SubmittedTokens d = s2s.submit_decode_with_id(cases.seq2seq[0].tokens);
  check(d.id != s.id, "submit_decode_with_id gave no fresh request id");
  if (d.result.wait_for(60s) != std::future_status::ready) {
    fail("seq2seq request with id: no completion within 60 s");
  } else {
    check_tokens(d.result.get(), cases.seq2seq[0].output_tokens, "seq2seq request with id");
  }
  // The models keep serving after the refusals.
  auto f = tree.submit_tree(cases.tree[0].tokens, cases.tree[0].parents);
  settle_f32(f, cases.tree[0].output, "tree request after refusals", good);
  check(good.load() == 1, "the treelstm did not serve after refusals");
  say("recurrent: bad inputs refused, policies checked against kinds, cancel by id");
}

}  // namespace

void run_recurrent(const std::string& mlp_dir, const std::string& lstm_dir,
                   const std::string& tree_dir, const std::string& s2s_dir,
                   const std::string& file) {
  const RecurrentCases cases = read_recurrent(file);
  serve::Runtime rt(serve::RuntimeOptions().backend("cpu").cpu_threads(2));
  unsigned long good = 0;
  {
    serve::ModelOptions cellular;
    cellular.policy(serve::Policy::cellular).workers(2).max_tasks_to_submit(2);
    good += run_recurrent_policy(rt, "cellular", cellular, lstm_dir, tree_dir, s2s_dir, cases);
  }
  {
    serve::ModelOptions padding;
    padding.policy(serve::Policy::padding).max_batch(4).state_slots(64);
    good += run_recurrent_policy(rt, "padding", padding, lstm_dir, tree_dir, s2s_dir, cases);
  }
  run_recurrent_errors(rt, mlp_dir, lstm_dir, tree_dir, s2s_dir, cases);
  rt.shutdown();
  serve::Stats st = rt.stats();
  check(st.completed_total() == st.submitted(), "recurrent stats: completed_total != submitted");
  check(st.completed(SERVE_CODE_OK) >= good, "recurrent stats: fewer OK than correct outputs");
  check(st.rejected() >= 12, "recurrent stats: " + std::to_string(st.rejected()) +
                                 " rejections, expected at least 12");
  check(st.in_flight() == 0, "recurrent stats: requests in flight after shutdown");
}

}  // namespace example
