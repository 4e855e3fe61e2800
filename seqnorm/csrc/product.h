// The per-step matmul of the recurrences: out = x W^T (+ add) with the same W (N, K) at every step of a call.
//
// Four routes, from BLAS-class libraries torch itself ships and one row's loop here:
// - "brgemm": oneDNN's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm, float32 on x86), over column
//   blocks of a row-major W^T split between threads: MKL's small-batch GEMM ran at half speed on an AMD EPYC, where
//   torch's own nn.LSTM (oneDNN's RNN) is fast (docs/benchmarks-archive.md).
// - "packed": MKL's packed GEMM (torch's mkl::_mkl_reorder_linear_weight / mkl::_mkl_linear), W packed once per
//   call: MKL otherwise repacks W at every step (docs/benchmarks-archive.md).
// - "blas": at::mm_out by W^T laid out row-major (float64, or no MKL / oneDNN): MKL's small-batch GEMM was faster
//   with it than with the transposed view (docs/performance.md).
// - "gemv": one row only (batch size 1), a plain vectorized matrix-vector product here (gemv_columns), its columns
//   split between the threads: at one row brgemm and MKL's sgemv ran at a fraction of the memory's speed
//   (docs/benchmarks-archive.md).
// Which route is fastest depends on the CPU, the shape and the thread count, so in float32 the candidates are
// measured once per process, shape and thread count: not on probe products before the work starts (that paused the
// first call at each new shape: docs/performance.md, "First calls do not pause"), but on the products the
// recurrences run anyway. Until a shape's route is chosen its products take the candidates in turn, in blocks
// (Trials). That is 36 products with three routes, within the first call of a recurrence of 36 steps or more; a
// shorter one leaves its timings to the next. set_product_route() forces one route (the tests run every route
// against the plain-PyTorch path); deterministic algorithms fix one (float_routes).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "process_mutex.h"
#include "vec.h"

namespace seqnorm {

enum class Route { kBlas, kPacked, kBrgemm, kGemv };

inline const char* route_name(Route route) {
  switch (route) {
    case Route::kBrgemm:
      return "brgemm";
    case Route::kPacked:
      return "packed";
    case Route::kGemv:
      return "gemv";
    default:
      return "blas";
  }
}

// The route to force where it applies, or none ("auto": measured per shape). An atomic: a recurrence in one thread
// reads it while another thread sets it (the bindings release the GIL), and a std::string read while it was
// assigned could see freed memory.
inline std::atomic<int>& route_setting() {
  static std::atomic<int> setting{-1};  // -1: auto, else a Route
  return setting;
}

// Sets route_setting() from its name: "auto", "brgemm", "packed" or "blas".
inline void set_route_setting(const std::string& name) {
  for (const Route route : {Route::kBrgemm, Route::kPacked, Route::kBlas, Route::kGemv}) {
    if (name == route_name(route)) {
      route_setting().store(int(route));
      return;
    }
  }
  if (name != "auto") {
    throw std::invalid_argument("set_product_route: expected auto, brgemm, packed, blas or gemv, got " + name);
  }
  route_setting().store(-1);
}

// The handles of torch's packed MKL linear (mkl::_mkl_reorder_linear_weight, mkl::_mkl_linear), where torch has them.
struct PackedLinear {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t)> reorder;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const c10::optional<at::Tensor>&, int64_t)>
      linear;
};

inline const PackedLinear* packed_linear() {
  static const std::optional<PackedLinear> ops = []() -> std::optional<PackedLinear> {
    if (!at::globalContext().hasMKL()) return std::nullopt;
    auto& dispatcher = c10::Dispatcher::singleton();
    const auto reorder = dispatcher.findSchema({"mkl::_mkl_reorder_linear_weight", ""});
    const auto linear = dispatcher.findSchema({"mkl::_mkl_linear", ""});
    if (!reorder.has_value() || !linear.has_value()) return std::nullopt;
    return PackedLinear{reorder->typed<at::Tensor(const at::Tensor&, int64_t)>(),
                        linear->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const c10::optional<at::Tensor>&, int64_t)>()};
  }();
  return ops.has_value() ? &*ops : nullptr;
}

// Whether torch's float32 brgemm runs here and multiplies correctly (it needs oneDNN's micro-kernels: x86, torch
// built with oneDNN), checked once on a small product against a plain loop.
inline bool brgemm_works() {
  static const bool works = [] {
#if defined(CPUBLAS_BRGEMM_F32F32F32) && (defined(__x86_64__) || defined(_M_X64))
    constexpr int64_t m = 3, k = 5, n = 70;
    std::vector<float> a(m * k), b(k * n), c(m * n, 0.f), want(m * n, 0.f);
    for (int64_t i = 0; i < m * k; ++i) a[i] = static_cast<float>(i % 7) - 3.f;
    for (int64_t i = 0; i < k * n; ++i) b[i] = static_cast<float>(i % 5) * 0.5f - 1.f;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p)
        for (int64_t j = 0; j < n; ++j) want[i * n + j] += a[i * k + p] * b[p * n + j];
    try {
      at::native::cpublas::brgemm(m, n, k, k, n, n, false, a.data(), b.data(), c.data(), false);
    } catch (const std::exception&) {
      return false;
    }
    for (int64_t i = 0; i < m * n; ++i) {
      if (std::abs(c[i] - want[i]) > 1e-4f * (1.f + std::abs(want[i]))) return false;
    }
    return true;
#else
    return false;
#endif
  }();
  return works;
}

// The rule that picks the fastest of a few candidates on the work itself, written once: the products' routes here
// and the generation step's weight layouts (seqnorm/layers/compiled.py, through the binding `Trials`).
//
// The candidates run in blocks of kBlock consecutive runs on the work as it comes, and a block counts by its fastest
// timed run, the first run not timed: after a switch a route runs slower for a run or two (each route keeps its own
// copy of W, which the others' runs have pushed out of the caches; oneDNN builds its micro-kernel on a first run).
// Timed one run each in turn, every route looked alike and the trial often chose a slow one (docs/performance.md).
// A round is one block of each candidate, in an order that rotates from round to round (round r starts with
// candidate r mod n), and a round is compared within itself — each candidate's time over the round's fastest —
// because a trial runs in a process's first calls, which speed up as they go. After kRounds rounds the lowest median
// of those ratios wins (the first on a tie). Runs of a shared Trials may overlap; a round in which some candidate got
// no timed run is not counted, and the trial goes on until kRounds rounds are.
class Trials {
 public:
  static constexpr int kBlock = 4;
  static constexpr int kRounds = 3;

  // Signed counts and indices, checked here: as size_t, pybind refused a negative one with its own TypeError.
  explicit Trials(int64_t candidates) : candidates_(checked_count(candidates)) {}

  // The candidate to run next.
  size_t turn() const {
    const size_t per_round = candidates_ * kBlock, round = runs_ / per_round;
    return (round + (runs_ % per_round) / kBlock) % candidates_;
  }

  // One run of `candidate` took `seconds`; the run that completes the rounds decides.
  void record(int64_t candidate, double seconds) {
    if (candidate < 0 || uint64_t(candidate) >= candidates_) {
      throw std::invalid_argument("Trials: expected a candidate from 0 to " + std::to_string(candidates_ - 1) +
                                  ", got " + std::to_string(candidate));
    }
    if (!std::isfinite(seconds) || seconds < 0) {  // a NaN would lose every comparison and decide nothing sensible
      std::ostringstream shown;
      shown << seconds;
      throw std::invalid_argument("Trials: expected seconds to be a finite number >= 0, got " + shown.str());
    }
    if (chosen_.has_value()) return;
    const size_t round = runs_ / (candidates_ * kBlock);
    const bool switch_run = runs_ % kBlock == 0;
    ++runs_;
    if (rounds_.size() <= round) rounds_.resize(round + 1, std::vector<std::vector<double>>(candidates_));
    if (!switch_run) rounds_[round][size_t(candidate)].push_back(seconds);
    if (runs_ % (candidates_ * kBlock) == 0) decide();
  }

  // The winner, once decided.
  std::optional<size_t> chosen() const { return chosen_; }

 private:
  static double median(std::vector<double> values) {
    const auto middle = values.begin() + values.size() / 2;
    std::nth_element(values.begin(), middle, values.end());
    return *middle;
  }

  static size_t checked_count(int64_t candidates) {
    if (candidates < 1) {
      throw std::invalid_argument("Trials: expected at least one candidate, got " + std::to_string(candidates));
    }
    return size_t(candidates);
  }

  void decide() {
    std::vector<std::vector<double>> ratios(candidates_);  // per candidate, its ratio in each complete round
    for (const std::vector<std::vector<double>>& round : rounds_) {
      if (std::any_of(round.begin(), round.end(), [](const std::vector<double>& times) { return times.empty(); })) {
        continue;
      }
      std::vector<double> best;  // per candidate, its block's fastest run
      for (const std::vector<double>& times : round) best.push_back(*std::min_element(times.begin(), times.end()));
      const double fastest = *std::min_element(best.begin(), best.end());
      for (size_t i = 0; i < candidates_; ++i) {
        ratios[i].push_back(fastest > 0 ? best[i] / fastest : (best[i] > 0 ? INFINITY : 1.0));
      }
    }
    if (ratios[0].size() < size_t(kRounds)) return;
    double best = INFINITY;
    for (size_t i = 0; i < candidates_; ++i) {
      const double ratio = median(ratios[i]);
      if (ratio < best) {
        best = ratio;
        chosen_ = i;
      }
    }
  }

  size_t candidates_;
  size_t runs_ = 0;
  std::vector<std::vector<std::vector<double>>> rounds_;  // per round, per candidate: its timed runs
  std::optional<size_t> chosen_;
};

// One shape's route choice (Key), shared by every product of that shape in the process: the candidates and their
// trials.
struct Tuning {
  std::vector<Route> candidates;
  Trials trials;
  std::optional<Route> chosen() const {
    const std::optional<size_t> index = trials.chosen();
    return index.has_value() ? std::optional<Route>(candidates[*index]) : std::nullopt;
  }
};

class StepProduct {
 public:
  // Packing gains nothing for a few rows (a matrix-vector product), where each step's fresh output and copy cost.
  static constexpr int64_t kPackedRows = 8;
  // Columns and depth (K) per brgemm call, accumulated over the depth: the whole depth at once took 3x longer at
  // K = 4096, and 64 by 256 was near the best block of every shape tried (docs/performance.md) and gives the threads
  // enough blocks to share.
  static constexpr int64_t kBlock = 64;
  static constexpr int64_t kDepth = 256;
  // out = x right, right (K, N): W^T of the forward's h W_hh^T (a transposed view, copied row-major once per
  // call), or W_hh itself in the backward (already row-major: no copy).
  StepProduct(const at::Tensor& right, int64_t rows) : rows_(rows) {
    std::vector<Route> candidates = {Route::kBlas};
    // An empty batch takes at::mm_out, which returns at once (brgemm does not take 0 rows).
    if (right.scalar_type() == at::kFloat && rows > 0) candidates = float_routes(rows);
    if (candidates.size() == 1) {
      route_ = candidates.front();
    } else {
      std::lock_guard<ProcessMutex> lock(tunings_mutex());
      const Key key{rows_, right.size(0), right.size(1), at::get_num_threads()};
      Tuning& tuning = tunings().try_emplace(key, Tuning{candidates, Trials(candidates.size())}).first->second;
      if (tuning.chosen().has_value()) {
        route_ = *tuning.chosen();
      } else {
        tuning_ = &tuning;  // std::map's elements stay where they are
      }
    }
    const auto needs = [&](Route route) {
      return tuning_ != nullptr ? std::find(candidates.begin(), candidates.end(), route) != candidates.end()
                                : route_ == route;
    };
    // The gemv route reads a transposed view of a row-major W (the forward's W_hh^T) as it is: no copy per call.
    const bool rows_given = !right.is_contiguous() && right.t().is_contiguous();
    if (needs(Route::kGemv) && rows_given) weight_rows_ = right.t();
    if (needs(Route::kBrgemm) || needs(Route::kBlas) || (needs(Route::kGemv) && !rows_given)) {
      right_ = right.contiguous();
    }
    if (needs(Route::kPacked)) {
      weight_ = right.t().contiguous();
      packed_ = packed_linear()->reorder.call(weight_, rows_);
    }
  }

  // The routes a float32 product of this many rows may take here, or the one route_setting() forces.
  static std::vector<Route> float_routes(int64_t rows) {
    std::vector<Route> candidates;
    if (brgemm_works()) candidates.push_back(Route::kBrgemm);
    if (rows >= kPackedRows && packed_linear() != nullptr) candidates.push_back(Route::kPacked);
    candidates.push_back(Route::kBlas);
    // Last: the deterministic route below stays what it was before this route came (a change of rounding).
    if (rows == 1) candidates.push_back(Route::kGemv);
    const int setting = route_setting().load();
    // Deterministic algorithms (torch.use_deterministic_algorithms, Lightning's deterministic=True): one fixed route,
    // the first available of brgemm, packed, at::mm. The measured choice depends on the machine's load when it is
    // timed, and each route rounds differently, so the same seed gave other numbers from one process to the next.
    if (setting < 0 && at::globalContext().deterministicAlgorithms()) return {candidates.front()};
    if (setting < 0) return candidates;
    const auto forced = std::find_if(candidates.begin(), candidates.end(),
                                     [&](Route route) { return setting == int(route); });
    return {forced != candidates.end() ? *forced : Route::kBlas};
  }

  // Whether this product's route is chosen (else its products are still timing the candidates).
  bool settled() const { return tuning_ == nullptr; }

  // The route chosen (settled() only).
  Route route() const { return route_; }

  void operator()(const at::Tensor& x, at::Tensor& out, const at::Tensor* add = nullptr) {
    if (tuning_ == nullptr) {
      run(route_, x, out, add);
    } else {
      timed(x, out, add);
    }
  }

  // The routes chosen in this process so far: (rows, K, N, threads, route) each.
  static std::vector<std::tuple<int64_t, int64_t, int64_t, int, std::string>> chosen_routes() {
    std::lock_guard<ProcessMutex> lock(tunings_mutex());
    std::vector<std::tuple<int64_t, int64_t, int64_t, int, std::string>> chosen;
    for (const auto& [key, tuning] : tunings()) {
      if (!tuning.chosen().has_value()) continue;
      const auto& [rows, depth, columns, threads] = key;
      chosen.emplace_back(rows, depth, columns, threads, route_name(*tuning.chosen()));
    }
    return chosen;
  }

  // For the tests: holds the trials' lock for `seconds` (from another thread, while the test forks).
  static void hold_lock(double seconds) {
    std::lock_guard<ProcessMutex> lock(tunings_mutex());
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }

  // For the tests: whether some thread holds the trials' lock now.
  static bool lock_held() {
    if (!tunings_mutex().try_lock()) return true;
    tunings_mutex().unlock();
    return false;
  }

 private:
  // Rows, K, N and torch's thread count: the fastest route at one thread is not always the fastest at two
  // (docs/benchmarks-archive.md).
  using Key = std::tuple<int64_t, int64_t, int64_t, int>;

  // The trials and choices of every shape: a ProcessMutex, which a fork leaves unlocked in the child.
  static ProcessMutex& tunings_mutex() {
    static ProcessMutex* mutex = new ProcessMutex();
    return *mutex;
  }

  static std::map<Key, Tuning>& tunings() {
    static std::map<Key, Tuning>* all = new std::map<Key, Tuning>();  // never destroyed, as its mutex
    return *all;
  }


  // One product of the shape's tuning, the candidate whose turn it is (Trials), timed; the last timing needed
  // chooses the route for every later product.
  void timed(const at::Tensor& x, at::Tensor& out, const at::Tensor* add) {
    size_t turn = 0;
    {
      std::lock_guard<ProcessMutex> lock(tunings_mutex());
      if (tuning_->chosen().has_value()) {  // chosen by another product of the shape since
        settle(*tuning_->chosen());
      } else {
        turn = tuning_->trials.turn();
      }
    }
    if (tuning_ == nullptr) {
      run(route_, x, out, add);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    run(tuning_->candidates[turn], x, out, add);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard<ProcessMutex> lock(tunings_mutex());
    tuning_->trials.record(turn, seconds);
    if (tuning_->chosen().has_value()) settle(*tuning_->chosen());
  }

  // From here on every product takes `route`; the other routes' operands are let go.
  void settle(Route route) {
    route_ = route;
    tuning_ = nullptr;
    if (route_ == Route::kPacked || (route_ == Route::kGemv && weight_rows_.defined())) right_ = at::Tensor();
    if (route_ != Route::kPacked) weight_ = packed_ = at::Tensor();
    if (route_ != Route::kGemv) weight_rows_ = at::Tensor();
  }

  void run(Route route, const at::Tensor& x, at::Tensor& out, const at::Tensor* add = nullptr) const {
    switch (route) {
      case Route::kBrgemm:
        if (out.is_contiguous()) {
          brgemm(x, out, add);
          return;
        }
        break;
      case Route::kGemv:
        if (out.is_contiguous() && x.size(0) == 1) {
          gemv(x, out, add);
          return;
        }
        break;
      case Route::kPacked: {
        const at::Tensor y = packed_linear()->linear.call(x, packed_, weight_, c10::nullopt, rows_);
        if (add != nullptr) {
          at::add_out(out, y, *add);
        } else {
          out.copy_(y);
        }
        return;
      }
      default:
        break;
    }
    if (add != nullptr) {
      at::addmm_out(out, *add, x, right_);
    } else {
      at::mm_out(out, x, right_);
    }
  }

  // out (contiguous) = x right (+ add), column block by column block, each accumulated over chunks of the depth;
  // `add` is copied into each block first and the product accumulated onto it.
  void brgemm(const at::Tensor& x, at::Tensor& out, const at::Tensor* add) const {
    const at::Tensor a = x.contiguous();
    const bool fused_add = add != nullptr && add->is_contiguous();
    if (add != nullptr && !fused_add) out.copy_(*add);
    const int64_t m = a.size(0), k = a.size(1), n = right_.size(1);
    const float* pa = a.data_ptr<float>();
    const float* pb = right_.data_ptr<float>();
    const float* pd = fused_add ? add->data_ptr<float>() : nullptr;
    float* pc = out.data_ptr<float>();
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t col = block * kBlock, width = std::min(kBlock, n - col);
        if (pd != nullptr) {
          for (int64_t r = 0; r < m; ++r) std::memcpy(pc + r * n + col, pd + r * n + col, width * sizeof(float));
        }
        for (int64_t first = 0; first < k; first += kDepth) {
          const int64_t depth = std::min(kDepth, k - first);
          at::native::cpublas::brgemm(m, width, depth, k, n, n, add != nullptr || first > 0, pa + first,
                                      pb + first * n + col, pc + col, false);
        }
      }
    });
  }

  // out (1 x N, contiguous) = x (1 x K) right (+ add), the columns split between threads in blocks of kBlock where
  // the product is big enough to pay for the fork: by rows of `right` (gemv_columns), or by dot products with the
  // rows of right^T where that is what the caller has (gemv_dots).
  void gemv(const at::Tensor& x, at::Tensor& out, const at::Tensor* add) const {
    const at::Tensor a = x.contiguous();
    const bool dots = weight_rows_.defined();
    const int64_t k = dots ? weight_rows_.size(1) : right_.size(0), n = dots ? weight_rows_.size(0) : right_.size(1);
    float* pc = out.data_ptr<float>();
    const float* pd = nullptr;
    if (add != nullptr) {
      if (!add->is_contiguous()) out.copy_(*add);
      pd = add->is_contiguous() ? add->data_ptr<float>() : pc;
    }
    const float* pa = a.data_ptr<float>();
    const float* pb = dots ? weight_rows_.data_ptr<float>() : right_.data_ptr<float>();
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    const auto columns = [&](int64_t begin, int64_t end) {
      if (dots) {
        gemv_dots(pa, pb, pd, pc, k, begin * kBlock, std::min(end * kBlock, n));
      } else {
        gemv_columns(pa, pb, pd, pc, k, n, begin * kBlock, std::min(end * kBlock, n));
      }
    };
    if (k * n >= kParallelProduct && at::get_num_threads() > 1 && !at::in_parallel_region()) {
      at::parallel_for(0, blocks, 1, columns);
    } else {
      columns(0, blocks);
    }
  }

  // Products of fewer multiply-adds than this run on one thread (gemv).
  static constexpr int64_t kParallelProduct = 65536;

  // out[j] = add[j] (or 0) + sum_p x[p] right[p][j] for the columns j in [begin, end), right row-major (depth x n);
  // four rows of `right` per pass over the columns (each output vector loaded and stored once per four), each
  // column summed in the order of p whatever the split between threads. `add` may be `out`.
  static void gemv_columns(const float* x, const float* right, const float* add, float* out, int64_t depth,
                           int64_t n, int64_t begin, int64_t end) {
    using V = Vec<float>;
    constexpr int64_t width = V::size();
    for (int64_t j = begin; j < end; j += width) {
      const int64_t count = std::min(width, end - j);
      store(add != nullptr ? load(add + j, count) : V(0.f), out + j, count);
    }
    int64_t p = 0;
    for (; p + 4 <= depth; p += 4) {
      const V x0(x[p]), x1(x[p + 1]), x2(x[p + 2]), x3(x[p + 3]);
      const float* r0 = right + p * n;
      const float *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
      for (int64_t j = begin; j < end; j += width) {
        const int64_t count = std::min(width, end - j);
        V sum = load(out + j, count);
        sum = at::vec::fmadd(x0, load(r0 + j, count), sum);
        sum = at::vec::fmadd(x1, load(r1 + j, count), sum);
        sum = at::vec::fmadd(x2, load(r2 + j, count), sum);
        sum = at::vec::fmadd(x3, load(r3 + j, count), sum);
        store(sum, out + j, count);
      }
    }
    for (; p < depth; ++p) {
      const V xp(x[p]);
      const float* row = right + p * n;
      for (int64_t j = begin; j < end; j += width) {
        const int64_t count = std::min(width, end - j);
        store(at::vec::fmadd(xp, load(row + j, count), load(out + j, count)), out + j, count);
      }
    }
  }

  // out[j] = add[j] (or 0) + sum_p x[p] weight[j][p] for j in [begin, end), weight row-major (n x depth): eight rows
  // of `weight` at a time against each vector of x, the eight sums reduced into one vector at the end (AVX2), each
  // output summed in the same order whatever the split between threads. `add` may be `out`.
  static void gemv_dots(const float* x, const float* weight, const float* add, float* out, int64_t depth,
                        int64_t begin, int64_t end) {
    using V = Vec<float>;
    constexpr int64_t width = V::size();
    const auto sums = [&](const float* rows, int64_t count, V* partial) {
      for (int64_t r = 0; r < count; ++r) partial[r] = V(0.f);
      for (int64_t p = 0; p < depth; p += width) {
        const int64_t lanes = std::min(width, depth - p);
        const V xp = load(x + p, lanes);
        for (int64_t r = 0; r < count; ++r) {
          partial[r] = at::vec::fmadd(load(rows + r * depth + p, lanes), xp, partial[r]);
        }
      }
    };
    int64_t j = begin;
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (width == 8) {
      for (; j + 8 <= end; j += 8) {
        V partial[8];
        sums(weight + j * depth, 8, partial);
        const __m256 t0 = _mm256_hadd_ps(partial[0], partial[1]), t1 = _mm256_hadd_ps(partial[2], partial[3]);
        const __m256 t2 = _mm256_hadd_ps(partial[4], partial[5]), t3 = _mm256_hadd_ps(partial[6], partial[7]);
        const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: sums 0-3, 4-7
        V total = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
        if (add != nullptr) total = total + V::loadu(add + j);
        total.store(out + j);
      }
    }
#endif
    for (; j < end; ++j) {
      V partial[1];
      sums(weight + j * depth, 1, partial);
      const float total = hsum(partial[0]);
      out[j] = add != nullptr ? add[j] + total : total;
    }
  }

  at::Tensor right_, weight_, packed_;  // x right; right^T and its MKL-packed form for the packed route
  at::Tensor weight_rows_;  // right^T where it is row-major as given, for the gemv route (undefined otherwise)
  int64_t rows_;
  Route route_ = Route::kBlas;
  Tuning* tuning_ = nullptr;  // while the shape's route is being measured
};

}  // namespace seqnorm
