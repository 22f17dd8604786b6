// Units of work handed out to whichever thread asks next, in place of at::parallel_for's equal contiguous shares.
//
// Why: on a shared machine one core is often slower than the other for a while (for example another tenant on its
// sibling hyperthread, or the OpenMP worker waking late after the Python between two calls), and with equal shares
// every parallel call waits for the slow one. On the 2-vCPU Xeon with AMX (model 207, 2026-11-28), 30 layers of paged
// decode attention over 64 requests x 288 tokens with equal shares: one thread busy 48-55 ms, the other 39-42 (the
// same work); taken from a shared queue, both 45-51 ms. Where the cores run alike each takes about half the runs.
//
// Units are claimed in runs of consecutive units that share their data (a request's kv heads read the same blocks'
// pages; a weight group's row chunks read its weights), so a run stays on one core. A thread claims its next run only
// when it starts the last unit of the current one, so that kernels can ask for the next unit's data ahead
// (WorkCursor::upcoming) while holding back at most one unit of work from the other threads.
//
// No result depends on which thread runs a unit: callers keep the per-unit arithmetic fixed.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

class WorkCursor {
 public:
  WorkCursor(std::atomic<int64_t>& next, int64_t total, int64_t run) : next_(next), total_(total), run_(run) {
    start(claim());
  }
  bool valid() const { return cur_ < total_; }
  int64_t unit() const { return cur_; }
  // The unit this thread runs after this one, or -1 when it has none left.
  int64_t upcoming() const {
    if (cur_ + 1 < end_) return cur_ + 1;
    return ahead_ < total_ ? ahead_ : -1;
  }
  void advance() {
    if (++cur_ < end_) {
      if (cur_ + 1 == end_) ahead_ = claim();
      return;
    }
    start(ahead_);
  }

 private:
  int64_t claim() { return next_.fetch_add(run_, std::memory_order_relaxed); }
  void start(int64_t first) {
    cur_ = std::min(first, total_);
    end_ = std::min(cur_ + run_, total_);
    ahead_ = total_;
    if (cur_ < total_ && cur_ + 1 == end_) ahead_ = claim();
  }

  std::atomic<int64_t>& next_;
  const int64_t total_, run_;
  int64_t cur_ = 0, end_ = 0, ahead_ = 0;
};

// Whether the environment variable `name` is exactly "0": the kernels' switches back to another path (tests, A/B).
inline bool env_is_zero(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == '0' && v[1] == '\0';
}

// LLMSERVE_WORK_QUEUE=0 (read once per process): every thread takes one equal contiguous share, as at::parallel_for
// splits a range, for A/B runs.
inline bool work_queue_enabled() {
  static const bool on = !env_is_zero("LLMSERVE_WORK_QUEUE");
  return on;
}

// body(WorkCursor& c) on each thread that takes part (per-thread scratch first, then
// `for (; c.valid(); c.advance()) ... c.unit() ...`); units [0, total) in runs of `run`.
template <typename Body>
inline void parallel_units(int64_t total, int64_t run, const Body& body) {
  if (total <= 0) return;
  run = std::max<int64_t>(run, 1);
  if (!work_queue_enabled()) run = (total + at::get_num_threads() - 1) / at::get_num_threads();  // equal shares
  std::atomic<int64_t> next{0};
  const int64_t runs = (total + run - 1) / run;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), runs), 1, [&](int64_t, int64_t) {
    WorkCursor c(next, total, run);
    body(c);
  });
}
