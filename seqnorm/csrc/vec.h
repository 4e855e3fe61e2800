// Vector helpers shared by the kernels: loads and stores of a partial vector at the end of a row, horizontal sums,
// the activations, and when to split a block of rows between threads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <array>
#include <cmath>
#include <cstdint>

namespace seqnorm {

template <typename T>
using Vec = at::vec::Vectorized<T>;

// fn(i, count) over [0, n) in whole vectors, then one partial vector (count < Vec::size()).
template <typename T, typename Fn>
inline void vec_loop(int64_t n, const Fn& fn) {
  constexpr int64_t width = Vec<T>::size();
  int64_t i = 0;
  for (; i + width <= n; i += width) fn(i, width);
  if (i < n) fn(i, n - i);
}

template <typename T>
inline Vec<T> load(const T* p, int64_t count) {
  return count == Vec<T>::size() ? Vec<T>::loadu(p) : Vec<T>::loadu(p, count);
}

template <typename T>
inline void store(const Vec<T>& v, T* p, int64_t count) {
  v.store(p, static_cast<int>(count));
}

// The lanes past count of a partial vector are zero after load(); a value that is not zero there (x - mean, say)
// must be cleared before it enters a sum.
template <typename T>
inline Vec<T> only(const Vec<T>& v, int64_t count) {
  return count == Vec<T>::size() ? v : Vec<T>::set(Vec<T>(T(0)), v, count);
}

template <typename T>
inline T hsum(const Vec<T>& v) {
  alignas(64) T lanes[Vec<T>::size()];
  v.store(lanes);
  T sum = 0;
  for (int64_t k = 0; k < Vec<T>::size(); ++k) sum += lanes[k];
  return sum;
}

// Independent partial sums per running sum: a single one waits out the adder's latency (4 cycles) at every vector.
// Four cut LayerNorm's forward_row by about a quarter (docs/performance.md).
constexpr int64_t kAccumulators = 4;

// The K sums over [0, n) that fn(i, count, sums) adds into sums[0..K) (Vec<T>) a vector at a time: whole vectors in
// turn into kAccumulators independent sets of K, then one partial vector (count < Vec::size()).
template <typename T, int64_t K, typename Fn>
inline std::array<T, K> vec_sums(int64_t n, const Fn& fn) {
  constexpr int64_t width = Vec<T>::size();
  Vec<T> partial[kAccumulators][K];
  for (auto& set : partial) {
    for (Vec<T>& sum : set) sum = Vec<T>(T(0));
  }
  int64_t i = 0;
  for (; i + kAccumulators * width <= n; i += kAccumulators * width) {
    for (int64_t a = 0; a < kAccumulators; ++a) fn(i + a * width, width, partial[a]);
  }
  int64_t a = 0;
  for (; i + width <= n; i += width, ++a) fn(i, width, partial[a]);
  if (i < n) fn(i, n - i, partial[a]);
  std::array<T, K> sums;
  for (int64_t k = 0; k < K; ++k) {
    Vec<T> total = partial[0][k];
    for (int64_t set = 1; set < kAccumulators; ++set) total = total + partial[set][k];
    sums[k] = hsum(total);
  }
  return sums;
}

// float: exp_u20 (relative error < 3e-7; measured 1.5x faster than the u10 exp on these machines); double: u10.
// exp_u20 clamps its argument with min/max, which turn NaN into the bound (exp(NaN) = 3.4e38, σ(NaN) = 0): a NaN
// input would leave the cell as zeros instead of NaN, so NaN lanes are put back (the plain path propagates them).
template <typename T>
inline Vec<T> vexp(const Vec<T>& x) {
  return x.exp();
}
template <>
inline Vec<float> vexp<float>(const Vec<float>& x) {
  return Vec<float>::blendv(x.exp_u20(), x, x.isnan());
}

template <typename T>
inline Vec<T> vsigmoid(const Vec<T>& x) {
  const Vec<T> one(T(1));
  return one / (one + vexp<T>(x.neg()));
}

// tanh(x) = 1 - 2 / (1 + exp(2x)): absolute error within a few units of the last place of 1 (the vectorized
// library tanh was 5x slower here); exp overflowing to inf gives exactly 1, underflowing to 0 exactly -1.
template <typename T>
inline Vec<T> vtanh(const Vec<T>& x) {
  const Vec<T> one(T(1)), two(T(2));
  return one - two / (one + vexp<T>(x * two));
}

// Blocks smaller than this many elements run on one thread: forking costs more than the work it would split.
constexpr int64_t kParallelElements = 16384;

// fn(begin, end) over the rows [0, rows) of a block `rows x width`, split between threads when it is big enough.
template <typename Fn>
inline void over_rows(int64_t rows, int64_t width, const Fn& fn) {
  if (rows > 1 && rows * width >= kParallelElements && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, rows, 1, fn);
  } else {
    fn(0, rows);
  }
}

// Features are summed over the rows a block of kBlockVectors vectors at a time, the sums held in registers.
constexpr int64_t kBlockVectors = 4;

// fn(begin, end) over feature ranges of a block `rows x features` (whole blocks of `block` features but the last),
// split between threads when the block is big enough. Sums over rows of disjoint features need no merging.
template <typename Fn>
inline void over_features(int64_t rows, int64_t features, int64_t block, const Fn& fn) {
  const int64_t blocks = (features + block - 1) / block;
  const auto run = [&](int64_t first, int64_t last) { fn(first * block, std::min(last * block, features)); };
  if (blocks > 1 && rows * features >= kParallelElements && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, blocks, 1, run);
  } else {
    run(0, blocks);
  }
}

// fn(j, vectors, counts) for every block of up to kBlockVectors vectors of features starting at feature j
// (counts[v]: the lanes of vector v, fewer in the last one), the blocks split between threads (over_features).
template <typename T, typename Fn>
inline void feature_blocks(int64_t rows, int64_t features, const Fn& fn) {
  constexpr int64_t width = Vec<T>::size(), block = kBlockVectors * width;
  over_features(rows, features, block, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; j += block) {
      const int64_t vectors = (std::min(block, end - j) + width - 1) / width;
      int64_t counts[kBlockVectors];
      for (int64_t v = 0; v < vectors; ++v) counts[v] = std::min(width, end - j - v * width);
      fn(j, vectors, counts);
    }
  });
}

}  // namespace seqnorm
