// The time loops of the kernels: a layer direction's recurrence (training forward, its backward through time) and
// the no-grad generation step, composed from the cells' gates (cells.h) and the norms' steps (norms.h).
//
// The matmuls stay BLAS-class calls into preallocated buffers (StepProduct, product.h: oneDNN's brgemm, MKL's packed
// GEMM, at::mm_out or, at one row, a vectorized matrix-vector loop, whichever was measured fastest for the shape);
// everything between them is one vectorized pass over the step's rows that takes each row through every norm and
// gate while it is in cache (two passes where a norm's statistics span the rows), split between threads by rows
// (at::parallel_for, OpenMP) where the block is big enough.
// seqnorm/layers/compiled.py wraps these in a torch.autograd.Function (the layers have checked every argument; the
// bindings, bindings.cpp, check them again, for any caller, then call the entry points at the end of this file); the
// plain-PyTorch paths (the loop over the cell's step, the reference loop) are what the tests compare them with.
#include <torch/extension.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "buffers.h"
#include "cells.h"
#include "checks.h"
#include "norms.h"
#include "product.h"
#include "recurrence.h"

namespace seqnorm {
namespace {


// Per step: the (B,) row of the padding mask when some row is padded, else null, and the number of real rows.
struct Padding {
  Padding(const c10::optional<at::Tensor>& mask, int64_t steps, int64_t rows) : rows_(rows) {
    if (mask.has_value() && mask->defined()) {
      mask_ = mask->contiguous();
      const bool* data = mask_.data_ptr<bool>();
      for (int64_t t = 0; t < steps; ++t) {
        int64_t count = 0;
        for (int64_t b = 0; b < rows; ++b) count += data[t * rows + b];
        counts_.push_back(count);
      }
    } else {
      counts_.assign(steps, rows);
    }
  }
  const bool* mask(int64_t t) const {
    return counts_[t] == rows_ ? nullptr : mask_.data_ptr<bool>() + t * rows_;
  }
  int64_t count(int64_t t) const { return counts_[t]; }

 private:
  int64_t rows_;
  at::Tensor mask_;
  std::vector<int64_t> counts_;
};

template <typename T>
T* ptr(const at::Tensor& t) {
  return t.data_ptr<T>();
}

// Padded rows pass the gradient of their state on unchanged: dh_next[b] += dh[b] where mask[b] is false.
template <typename T>
void add_padded_rows(T* dh_next, const T* dh, const bool* mask, int64_t rows, int64_t hidden) {
  if (mask == nullptr) return;
  for (int64_t b = 0; b < rows; ++b) {
    if (mask[b]) continue;
    for (int64_t j = 0; j < hidden; ++j) dh_next[b * hidden + j] += dh[b * hidden + j];
  }
}

// fn(b) for every real row b of a step (mask false: padded; null: every row), rows split between threads.
template <typename Fn>
void over_real_rows(int64_t rows, int64_t width, const bool* mask, const Fn& fn) {
  over_rows(rows, width, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (mask == nullptr || mask[b]) fn(b);
    }
  });
}

// Zeroes the padded rows (mask false) of each non-null block (rows x width): they get no gradient.
template <typename T>
void clear_padded_rows(const bool* mask, int64_t rows, int64_t width, std::initializer_list<T*> blocks) {
  if (mask == nullptr) return;
  for (int64_t b = 0; b < rows; ++b) {
    if (mask[b]) continue;
    for (T* block : blocks) {
      if (block != nullptr) std::fill(block + b * width, block + (b + 1) * width, T(0));
    }
  }
}

// The input and recurrent norms' backward pieces of one step, for either cell: each norm's output gradient dy, its
// input x (W_ih x, W_hh h) and its input gradient dx, all (rows x gates) at the step; a norm that is the identity
// is skipped (its gradient is the caller's dy itself).
template <typename T>
struct TermsBackward {
  StepNorm<T>& ih;
  StepNorm<T>& hh;
  int64_t t, gates;
  const T *dy_ih, *x_ih, *dy_hh, *x_hh;
  T *dx_ih, *dx_hh;

  // Whether rows() may follow sums() row by row (both norms keep statistics per row).
  bool local() const { return ih.row_local() && hh.row_local(); }
  void sums(int64_t b) const {
    const int64_t at = b * gates;
    if (!ih.identity()) ih.backward_sums(t, b, dy_ih + at, x_ih + at);
    if (!hh.identity()) hh.backward_sums(t, b, dy_hh + at, x_hh + at);
  }
  void finish(int64_t count) const {
    ih.finish_sums(t, count);
    hh.finish_sums(t, count);
  }
  void rows(int64_t b) const {
    const int64_t at = b * gates;
    if (!ih.identity()) ih.backward_row(t, b, dy_ih + at, x_ih + at, dx_ih + at);
    if (!hh.identity()) hh.backward_row(t, b, dy_hh + at, x_hh + at, dx_hh + at);
  }
};

// A gradient the backward computes step by step, (B, G) per step, and consumes only in matmuls over the steps
// (W_hh's gradient; the input projection's, where the recurrence was handed the input and W_ih): kept for a chunk of
// about kChunkRows rows in one buffer the chunks reuse, each chunk handed to `consume(first, grads)` (grads: the
// chunk's steps from `first` on, (count, B, G)) once the backward, walking back through time, has finished the
// chunk's first step. Kept for all T steps in a fresh (T, B, G) buffer instead, it cost that buffer's page faults at
// every backward (a fresh buffer fills about ten times slower than a reused one: docs/benchmarks-archive.md), and a
// product over ~1024 rows runs as fast as one over all of them. Where the gradient is kept for every step anyway
// (a result), `full` is that (T, B, G) tensor and no buffer is made.
class StepChunks {
 public:
  static constexpr int64_t kChunkRows = 1024;
  using Consumer = std::function<void(int64_t, const at::Tensor&)>;

  StepChunks(int64_t steps, int64_t rows, int64_t gates, const at::TensorOptions& options, Consumer consume,
             const at::Tensor& full = at::Tensor())
      : steps_(steps), consume_(std::move(consume)) {
    chunk_ = full.defined() ? steps : std::min(steps, std::max<int64_t>(1, kChunkRows / std::max<int64_t>(rows, 1)));
    buffer_ = full.defined() ? full : at::empty({chunk_, rows, gates}, options);
  }

  // Where step t's gradient goes, (B, G); the steps come from the last to the first.
  at::Tensor step(int64_t t) const { return buffer_[t % chunk_]; }

  // Step t's gradient is complete; at the first step of a chunk, the chunk is consumed.
  void done(int64_t t) const {
    if (t % chunk_ == 0) consume_(t, buffer_.narrow(0, 0, std::min(chunk_, steps_ - t)));
  }

 private:
  int64_t steps_, chunk_;
  at::Tensor buffer_;
  Consumer consume_;
};

// dL/dW_hh += Σ_s dL/d(W_hh h_{s-1})^T h_{s-1} over a chunk's steps s = first, first + 1, ... (h_{-1} is h0).
StepChunks::Consumer weight_hh_grad(at::Tensor& grad, const at::Tensor& h0, const at::Tensor& hs) {
  return [&grad, &h0, &hs](int64_t first, const at::Tensor& grads) {
    const int64_t count = grads.size(0), from = first == 0 ? 1 : 0;  // the steps whose previous state is in hs
    if (first == 0) grad.addmm_(grads[0].t(), h0);
    if (count > from) {
      grad.addmm_(grads.narrow(0, from, count - from).reshape({-1, grads.size(2)}).t(),
                  hs.narrow(0, first + from - 1, count - from).reshape({-1, hs.size(2)}));
    }
  };
}

// The input projection W_ih x of the recurrence's input, where the recurrence was handed x and W_ih rather than the
// projection (seqnorm/layers/compiled.py: when the input norm runs in the kernels): the gradients of x and W_ih from
// the projection's, a chunk of steps at a time (dx = g W_ih, dW_ih += g^T x; undefined where not wanted).
struct Projection {
  at::Tensor x, weight, grad_x, grad_weight;

  Projection(const c10::optional<at::Tensor>& sequence, const c10::optional<at::Tensor>& weight_ih, bool want_x,
             bool want_weight) {
    if (!sequence.has_value() || !sequence->defined()) return;
    x = *sequence;
    weight = *weight_ih;
    if (want_x) grad_x = at::empty(x.sizes(), x.options());
    if (want_weight) grad_weight = at::zeros(weight.sizes(), weight.options());
  }
  // consumer() refers to this object: a copy would leave it pointing at the original.
  Projection(const Projection&) = delete;
  Projection& operator=(const Projection&) = delete;
  bool defined() const { return x.defined(); }

  StepChunks::Consumer consumer() {
    return [this](int64_t first, const at::Tensor& grads) {
      const int64_t count = grads.size(0);
      const at::Tensor rows = grads.reshape({-1, grads.size(2)});
      if (grad_x.defined()) {
        at::Tensor out = grad_x.narrow(0, first, count).view({-1, x.size(2)});
        at::mm_out(out, rows, weight);
      }
      if (grad_weight.defined()) grad_weight.addmm_(rows.t(), x.narrow(0, first, count).reshape({-1, x.size(2)}));
    };
  }
};

// ---- LSTM ------------------------------------------------------------------------------------------------------

// One LSTM step's blocks (rows x 4H or rows x H, at the step) once W_hh h is computed; `input` and `raw` may be null.
template <typename T>
struct LstmStep {
  const T* input;  // the input terms, or W_ih x for the input norm; null: `pre` holds them (and W_hh h) already
  const T* raw;    // W_hh h for the recurrent norm (null with `input`)
  T* pre;          // the pre-activations (written here unless both are null)
  T* acts;
  const T* c_prev;
  T* c;            // c' (a padded row: c_prev)
  T* c_out;        // N_c(c'), null without a cell-state norm
  T* tanh_c;
  T* h;            // h' (a padded row: h_prev)
  const T* h_prev;
};

// Step t of an LSTM from W_hh h on (training forward and generation step alike): pre = N_ih(W_ih x) + N_hh(W_hh h),
// the gates, c' and N_c(c'), h'. One pass over the rows, each row from its terms to h' while it is in cache, when
// the norms keep their statistics per row; per-timestep BN's statistics over the rows come first (the cell-state
// norm's after every row's c', its rows' remaining work in a second pass).
template <typename T>
void lstm_step(StepNorm<T>& norm_ih, StepNorm<T>& norm_hh, StepNorm<T>& norm_c, int64_t t, const LstmStep<T>& s,
               const bool* mask, int64_t count, int64_t rows, int64_t hidden) {
  const int64_t gates = 4 * hidden;
  if (s.raw != nullptr) {
    if (!norm_ih.identity()) norm_ih.forward_stats(t, s.input, mask, count);
    norm_hh.forward_stats(t, s.raw, mask, count);
  }
  const bool c_local = norm_c.row_local();
  const auto output_row = [&](int64_t b) {
    const int64_t at = b * hidden;
    const T* c_normed = s.c + at;
    if (s.c_out != nullptr) {
      norm_c.forward_row(t, b, s.c + at, s.c_out + at, nullptr);
      c_normed = s.c_out + at;
    }
    lstm_output(c_normed, s.acts + b * gates, s.tanh_c + at, s.h + at, s.c + at, s.h_prev + at, s.c_prev + at,
                mask != nullptr && !mask[b], hidden);
  };
  const auto gate_row = [&](int64_t b) {
    const int64_t at = b * gates;
    if (s.raw != nullptr) {
      // The input term, normalized into pre or as it is, is the recurrent norm's addend.
      const T* term = s.input + at;
      if (!norm_ih.identity()) {
        norm_ih.forward_row(t, b, s.input + at, s.pre + at, nullptr);
        term = s.pre + at;
      }
      norm_hh.forward_row(t, b, s.raw + at, s.pre + at, term);
    }
    lstm_gates(s.pre + at, s.acts + at, s.c_prev + b * hidden, s.c + b * hidden, hidden);
    if (c_local) output_row(b);
  };
  over_rows(rows, gates, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) gate_row(b);
  });
  if (!c_local) {
    norm_c.forward_stats(t, s.c, mask, count);
    over_rows(rows, hidden, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) output_row(b);
    });
  }
}

// The forward of one direction. `inputs` (T, B, 4H) are the input projections W_ih x, which the input norm
// normalizes step by step (its shift carries the biases), or with no input norm the finished input terms.
// Returns hs, h_n, c_n; what the backward needs: cs, acts, tanh_cs and raw (W_hh h, undefined without a recurrent
// norm); each norm's saved statistics (input, recurrent, cell state); and each norm's fallback steps.
template <typename T>
std::tuple<Tensors, Tensors, std::vector<Tensors>, std::vector<int64_t>> lstm_forward(
    const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0, const at::Tensor& weight_hh,
    const c10::optional<at::Tensor>& mask, const NormArgs& ih_args, const NormArgs& hh_args, const NormArgs& c_args,
    bool save) {
  const int64_t steps = inputs.size(0), rows = inputs.size(1), gates = inputs.size(2), hidden = gates / 4;
  const auto options = inputs.options();
  const Padding padding(mask, steps, rows);
  auto norm_ih = make_norm<T>(ih_args, steps, rows, gates, options, {});
  auto norm_hh = make_norm<T>(hh_args, steps, rows, gates, options, {});
  auto norm_c = make_norm<T>(c_args, steps, rows, hidden, options, {});
  // Without a gradient only the current step is kept (c: the current and the previous).
  const int64_t kept = save ? steps : 1;
  at::Tensor hs = at::empty({steps, rows, hidden}, options);
  at::Tensor cs = saved_empty({save ? steps : 2, rows, hidden}, options);
  at::Tensor acts = saved_empty({kept, rows, gates}, options);
  at::Tensor tanh_cs = saved_empty({kept, rows, hidden}, options);
  at::Tensor raw = norm_hh->identity() ? at::Tensor() : saved_empty({kept, rows, gates}, options);
  at::Tensor pre = at::empty({rows, gates}, options);
  at::Tensor c_out = norm_c->identity() ? at::Tensor() : at::empty({rows, hidden}, options);
  StepProduct recurrent(weight_hh.t(), rows);  // h W_hh^T
  const Tensors input = inputs.unbind(0), h = hs.unbind(0), c = cs.unbind(0);
  Tensors raw_t = raw.defined() ? raw.unbind(0) : Tensors();
  for (int64_t t = 0; t < steps; ++t) {
    const int64_t slot = save ? t : 0, c_slot = save ? t : t % 2;
    const bool* m = padding.mask(t);
    const int64_t count = padding.count(t);
    const at::Tensor& h_prev = t == 0 ? h0 : h[t - 1];
    const at::Tensor& c_prev = t == 0 ? c0 : c[save ? t - 1 : (t - 1) % 2];
    LstmStep<T> step{nullptr,
                     nullptr,
                     ptr<T>(pre),
                     ptr<T>(acts) + slot * rows * gates,
                     ptr<T>(c_prev),
                     ptr<T>(c[c_slot]),
                     c_out.defined() ? ptr<T>(c_out) : nullptr,
                     ptr<T>(tanh_cs) + slot * rows * hidden,
                     ptr<T>(h[t]),
                     ptr<T>(h_prev)};
    if (raw.defined()) {
      recurrent(h_prev, raw_t[slot]);
      step.input = ptr<T>(input[t]);
      step.raw = ptr<T>(raw_t[slot]);
    } else {
      // No recurrent norm: the input term goes into the pre-activations first and the product adds W_hh h to it
      // there (one (B, 4H) buffer fewer for the caches to hold between the steps' matmuls).
      const bool normed_input = !norm_ih->identity();
      if (normed_input) norm_ih->forward(t, ptr<T>(input[t]), ptr<T>(pre), nullptr, m, count);
      recurrent(h_prev, pre, normed_input ? &pre : &input[t]);
    }
    lstm_step(*norm_ih, *norm_hh, *norm_c, t, step, m, count, rows, hidden);
  }
  const at::Tensor h_n = hs[steps - 1].clone(), c_n = c[save ? steps - 1 : (steps - 1) % 2].clone();
  Tensors saved;
  std::vector<Tensors> stats;
  if (save) {
    saved = {cs, acts, tanh_cs, raw};  // raw last: None in Python when undefined
    stats = {norm_ih->saved(false), norm_hh->saved(false), norm_c->saved(false)};
  }
  return {Tensors{hs, h_n, c_n}, saved, stats,
          {norm_ih->fallback_steps(), norm_hh->fallback_steps(), norm_c->fallback_steps()}};
}

// Returns the gradients of inputs (of the projection's input x with `sequence`), h0, c0, W_hh, then (γ, shift) of
// the input, recurrent and cell-state norms, then W_ih's (with `sequence`; else undefined).
template <typename T>
Tensors lstm_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& grad_c_n,
                      const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0,
                      const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask, const at::Tensor& hs,
                      const Tensors& saved, const c10::optional<at::Tensor>& raw_saved,
                      const std::vector<Tensors>& stats, const NormArgs& ih_args, const NormArgs& hh_args,
                      const NormArgs& c_args, Projection projection) {
  const at::Tensor &cs = saved.at(0), &acts = saved.at(1), &tanh_cs = saved.at(2);
  const at::Tensor raw = raw_saved.has_value() ? *raw_saved : at::Tensor();
  const int64_t steps = acts.size(0), rows = acts.size(1), gates = acts.size(2), hidden = gates / 4;
  const auto options = acts.options();
  const Padding padding(mask, steps, rows);
  auto norm_ih = make_norm<T>(ih_args, steps, rows, gates, options, stats.at(0));
  auto norm_hh = make_norm<T>(hh_args, steps, rows, gates, options, stats.at(1));
  auto norm_c = make_norm<T>(c_args, steps, rows, hidden, options, stats.at(2));
  // The pre-activations' gradient is kept for every step where it is a result (the input terms' gradient without
  // an input norm). Without a recurrent norm it is W_hh h's gradient as well, kept for a chunk of steps
  // (StepChunks); between two norms it is one step's scratch. The input norm's dx is a result too, unless the
  // projection's gradients take it a chunk at a time.
  const bool input_normed = !norm_ih->identity(), recurrent_normed = raw.defined();
  TORCH_CHECK(input_normed || !projection.defined(), "seqnorm kernels: a projection is handed over with an input norm");
  const bool keep_pre = !input_normed;
  at::Tensor grad_terms = keep_pre || recurrent_normed ? at::empty({keep_pre ? steps : 1, rows, gates}, options)
                                                       : at::Tensor();
  at::Tensor grad_inputs = !input_normed ? grad_terms
                           : projection.defined() ? at::Tensor()
                                                  : at::empty({steps, rows, gates}, options);
  const StepChunks input_grad(steps, rows, gates, options, projection.consumer(), grad_inputs);
  at::Tensor grad_weight_hh = at::zeros({gates, hidden}, options);
  const StepChunks recurrent_grad(steps, rows, gates, options, weight_hh_grad(grad_weight_hh, h0, hs),
                                  keep_pre && !recurrent_normed ? grad_terms : at::Tensor());
  at::Tensor dh = grad_h_n + grad_hs[steps - 1];
  at::Tensor dh_next = at::empty({rows, hidden}, options);
  at::Tensor dc = grad_c_n.clone();
  at::Tensor d_c_out = at::empty({rows, hidden}, options);
  at::Tensor dc_norm = norm_c->identity() ? d_c_out : at::empty({rows, hidden}, options);
  StepProduct back(weight_hh, rows);  // dL/d(W_hh h) W_hh
  const Tensors grad_out = grad_hs.unbind(0);
  // A step's work between the matmuls is one pass over its rows when every norm keeps its statistics per row
  // (none, LayerNorm, RMSNorm): a row's gradient goes from dh through the cell-state norm, the gates and the input
  // and recurrent norms while it is in cache. A norm whose statistics span the rows (per-timestep BN) needs every
  // row's sums before any row's dx, and the rest of the row's work moves to a pass after that.
  const bool c_local = norm_c->row_local(), c_normed = !norm_c->identity();
  for (int64_t t = steps - 1; t >= 0; --t) {
    const bool* m = padding.mask(t);
    const int64_t count = padding.count(t), block = t * rows * gates;
    const T* a = ptr<T>(acts) + block;
    const T* tanh_c = ptr<T>(tanh_cs) + t * rows * hidden;
    const T* c_t = ptr<T>(cs) + t * rows * hidden;
    const T* c_prev = t == 0 ? ptr<T>(c0) : ptr<T>(cs) + (t - 1) * rows * hidden;
    const at::Tensor grad_step = recurrent_grad.step(t);  // dL/d(W_hh h) at step t
    T* grad_rec = ptr<T>(grad_step);
    T* grad_pre = recurrent_normed ? ptr<T>(grad_terms) + (keep_pre ? block : 0) : grad_rec;
    T* grad_in = ptr<T>(input_grad.step(t));
    T *d_h = ptr<T>(dh), *d_c = ptr<T>(dc), *d_out = ptr<T>(d_c_out), *d_norm = ptr<T>(dc_norm);
    const TermsBackward<T> terms{*norm_ih,
                                 *norm_hh,
                                 t,
                                 gates,
                                 grad_pre,
                                 input_normed ? ptr<T>(inputs) + block : nullptr,
                                 grad_pre,
                                 recurrent_normed ? ptr<T>(raw) + block : nullptr,
                                 grad_in,
                                 grad_rec};
    // Row b's pieces, from the last (N_c's dx, the gates, the terms' norms) to the first (dh to N_c's output).
    const auto gate_rows = [&](int64_t b) {
      const int64_t at = b * hidden;
      if (c_normed) norm_c->backward_row(t, b, d_out + at, c_t + at, d_norm + at);
      lstm_gates_backward(d_h + at, d_c + at, d_norm + at, a + b * gates, tanh_c + at, c_prev + at,
                          grad_pre + b * gates, hidden);
      terms.sums(b);
      if (terms.local()) terms.rows(b);
    };
    const auto output_rows = [&](int64_t b) {
      const int64_t at = b * hidden;
      lstm_output_backward(d_h + at, a + b * gates, tanh_c + at, d_out + at, hidden);
      if (c_normed) norm_c->backward_sums(t, b, d_out + at, c_t + at);
      if (c_local) gate_rows(b);
    };
    // Padded rows pass dc on as it is.
    clear_padded_rows<T>(m, rows, gates,
                         {grad_pre, input_normed ? grad_in : nullptr, recurrent_normed ? grad_rec : nullptr});
    over_real_rows(rows, gates, m, output_rows);
    if (!c_local) {
      norm_c->finish_sums(t, count);
      over_real_rows(rows, gates, m, gate_rows);
    }
    if (!terms.local()) {
      terms.finish(count);
      over_real_rows(rows, gates, m, [&](int64_t b) { terms.rows(b); });
    }
    back(grad_step, dh_next, t > 0 ? &grad_out[t - 1] : nullptr);
    recurrent_grad.done(t);
    input_grad.done(t);
    add_padded_rows(ptr<T>(dh_next), ptr<T>(dh), m, rows, hidden);
    std::swap(dh, dh_next);
  }
  const auto ih_grads = norm_ih->parameter_grads();
  const auto hh_grads = norm_hh->parameter_grads();
  const auto c_grads = norm_c->parameter_grads();
  return {projection.defined() ? projection.grad_x : grad_inputs,
          dh,
          dc,
          grad_weight_hh,
          ih_grads.first,
          ih_grads.second,
          hh_grads.first,
          hh_grads.second,
          c_grads.first,
          c_grads.second,
          projection.grad_weight};
}

// ---- GRU -------------------------------------------------------------------------------------------------------

// One GRU step's blocks (rows x 3H or rows x H, at the step) once W_hh h is computed.
template <typename T>
struct GruStep {
  const T* input;  // the input terms, or W_ih x for the input norm
  const T* raw;    // W_hh h
  T* term;         // the input norm's output (unused without one; never `input`)
  T* u;            // the recurrent terms N_hh(W_hh h) + b_hh (unused when the recurrent norm is the identity; never
                   // `raw`)
  T* acts;
  T* h;            // h' (a padded row: h_prev)
  const T* h_prev;
};

// Step t of a GRU from W_hh h on (training forward and generation step alike): the input and recurrent norms, the
// gates and h', one pass over the rows, each row from its terms to h' while it is in cache (per-timestep BN's
// statistics over the rows first).
template <typename T>
void gru_step(StepNorm<T>& norm_ih, StepNorm<T>& norm_hh, int64_t t, const GruStep<T>& s, const bool* mask,
              int64_t count, int64_t rows, int64_t hidden) {
  const int64_t gates = 3 * hidden;
  norm_ih.forward_stats(t, s.input, mask, count);
  norm_hh.forward_stats(t, s.raw, mask, count);
  over_rows(rows, gates, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t at = b * gates;
      const T* a = s.input + at;
      if (!norm_ih.identity()) {
        norm_ih.forward_row(t, b, s.input + at, s.term + at, nullptr);
        a = s.term + at;
      }
      const T* u = s.raw + at;
      if (!norm_hh.identity()) {
        norm_hh.forward_row(t, b, s.raw + at, s.u + at, nullptr);
        u = s.u + at;
      }
      gru_gates(a, u, s.acts + at, s.h_prev + b * hidden, s.h + b * hidden, mask != nullptr && !mask[b], hidden);
    }
  });
}

// As lstm_forward: `inputs` (T, B, 3H) are W_ih x for the input norm, or the finished input terms. Returns hs, h_n;
// raw; the input and recurrent norms' saved statistics; their fallback steps. The caller keeps `inputs` for the
// backward, which recomputes the gates from them and raw.
template <typename T>
std::tuple<Tensors, Tensors, std::vector<Tensors>, std::vector<int64_t>> gru_forward(
    const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& weight_hh,
    const c10::optional<at::Tensor>& mask, const NormArgs& ih_args, const NormArgs& hh_args, bool save) {
  const int64_t steps = inputs.size(0), rows = inputs.size(1), gates = inputs.size(2), hidden = gates / 3;
  const auto options = inputs.options();
  const Padding padding(mask, steps, rows);
  auto norm_ih = make_norm<T>(ih_args, steps, rows, gates, options, {});
  auto norm_hh = make_norm<T>(hh_args, steps, rows, gates, options, {});
  const int64_t kept = save ? steps : 1;
  at::Tensor hs = at::empty({steps, rows, hidden}, options);
  // The gates are recomputed in the backward from the saved terms: a GRU keeps W_ih x and W_hh h, not its gates.
  at::Tensor acts = at::empty({1, rows, gates}, options);
  at::Tensor raw = saved_empty({kept, rows, gates}, options);
  at::Tensor term = norm_ih->identity() ? at::Tensor() : at::empty({rows, gates}, options);
  at::Tensor u = norm_hh->identity() ? at::Tensor() : at::empty({rows, gates}, options);
  StepProduct recurrent(weight_hh.t(), rows);  // h W_hh^T
  const Tensors input = inputs.unbind(0), h = hs.unbind(0);
  Tensors raw_t = raw.unbind(0);
  for (int64_t t = 0; t < steps; ++t) {
    const int64_t slot = save ? t : 0;
    const at::Tensor& h_prev = t == 0 ? h0 : h[t - 1];
    recurrent(h_prev, raw_t[slot]);
    const GruStep<T> step{ptr<T>(input[t]),
                          ptr<T>(raw_t[slot]),
                          term.defined() ? ptr<T>(term) : nullptr,
                          u.defined() ? ptr<T>(u) : nullptr,
                          ptr<T>(acts),
                          ptr<T>(h[t]),
                          ptr<T>(h_prev)};
    gru_step(*norm_ih, *norm_hh, t, step, padding.mask(t), padding.count(t), rows, hidden);
  }
  Tensors saved;
  std::vector<Tensors> stats;
  if (save) {
    saved = {raw};
    // The backward recomputes the terms from inputs and raw, and what statistics it can from them too.
    stats = {norm_ih->saved(true), norm_hh->saved(true)};
  }
  return {Tensors{hs, hs[steps - 1].clone()}, saved, stats, {norm_ih->fallback_steps(), norm_hh->fallback_steps()}};
}

// Returns the gradients of inputs (of the projection's input x with `sequence`), h0, W_hh, then (γ, shift) of the
// input and recurrent norms, then W_ih's (with `sequence`; else undefined).
template <typename T>
Tensors gru_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& inputs,
                     const at::Tensor& h0, const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask,
                     const at::Tensor& hs, const Tensors& saved, const std::vector<Tensors>& stats,
                     const NormArgs& ih_args, const NormArgs& hh_args, Projection projection) {
  const at::Tensor& raw = saved.at(0);
  const int64_t steps = raw.size(0), rows = raw.size(1), gates = raw.size(2), hidden = gates / 3;
  const auto options = raw.options();
  const Padding padding(mask, steps, rows);
  auto norm_ih = make_norm<T>(ih_args, steps, rows, gates, options, stats.at(0));
  auto norm_hh = make_norm<T>(hh_args, steps, rows, gates, options, stats.at(1));
  // The input terms' gradient is kept for every step only without an input norm (it is the result then); the input
  // norm's dx is a result too, unless the projection's gradients take it a chunk at a time (StepChunks).
  const bool input_normed = !norm_ih->identity(), recurrent_normed = !norm_hh->identity();
  TORCH_CHECK(input_normed || !projection.defined(), "seqnorm kernels: a projection is handed over with an input norm");
  at::Tensor grad_terms = at::empty({input_normed ? 1 : steps, rows, gates}, options);
  at::Tensor grad_inputs = !input_normed ? grad_terms
                           : projection.defined() ? at::Tensor()
                                                  : at::empty({steps, rows, gates}, options);
  const StepChunks input_grad(steps, rows, gates, options, projection.consumer(), grad_inputs);
  at::Tensor grad_weight_hh = at::zeros({gates, hidden}, options);
  const StepChunks recurrent_grad(steps, rows, gates, options, weight_hh_grad(grad_weight_hh, h0, hs));
  at::Tensor du = recurrent_normed ? at::empty({rows, gates}, options) : at::Tensor();
  // The step's terms and gates, recomputed from the saved W_ih x, W_hh h and statistics.
  at::Tensor a = input_normed ? at::empty({rows, gates}, options) : at::Tensor();
  at::Tensor u = recurrent_normed ? at::empty({rows, gates}, options) : at::Tensor();
  at::Tensor acts = at::empty({rows, gates}, options);
  at::Tensor dh = grad_h_n + grad_hs[steps - 1];
  at::Tensor dh_next = at::empty({rows, hidden}, options);
  StepProduct back(weight_hh, rows);  // dL/d(W_hh h) W_hh
  const Tensors grad_out = grad_hs.unbind(0);
  // As the LSTM's backward: one pass over the rows per step when the norms keep statistics per row, a second for
  // the norms' dx when one's statistics span the rows.
  for (int64_t t = steps - 1; t >= 0; --t) {
    const bool* m = padding.mask(t);
    const int64_t count = padding.count(t), block = t * rows * gates;
    const T* x_raw = ptr<T>(raw) + block;
    const T* x_in = ptr<T>(inputs) + block;
    const T* h_prev = t == 0 ? ptr<T>(h0) : ptr<T>(hs) + (t - 1) * rows * hidden;
    T* grad_a = ptr<T>(grad_terms) + (input_normed ? 0 : block);
    T* grad_in = ptr<T>(input_grad.step(t));
    const at::Tensor grad_step = recurrent_grad.step(t);  // dL/d(W_hh h) at step t
    T* grad_rec = ptr<T>(grad_step);
    T* grad_u = recurrent_normed ? ptr<T>(du) : grad_rec;
    T* d_h = ptr<T>(dh);
    norm_ih->recompute_stats(t, x_in, m, count);
    norm_hh->recompute_stats(t, x_raw, m, count);
    const TermsBackward<T> terms{*norm_ih, *norm_hh, t, gates, grad_a, x_in, grad_u, x_raw, grad_in, grad_rec};
    const auto gate_rows = [&](int64_t b) {
      const int64_t at = b * gates;
      const T* input_terms = x_in + at;
      if (input_normed) {
        norm_ih->normalized_row(t, b, x_in + at, ptr<T>(a) + at);
        input_terms = ptr<T>(a) + at;
      }
      const T* recurrent_terms = x_raw + at;
      if (recurrent_normed) {
        norm_hh->normalized_row(t, b, x_raw + at, ptr<T>(u) + at);
        recurrent_terms = ptr<T>(u) + at;
      }
      gru_gates<T>(input_terms, recurrent_terms, ptr<T>(acts) + at, h_prev + b * hidden, nullptr, false, hidden);
      gru_gates_backward(d_h + b * hidden, ptr<T>(acts) + at, recurrent_terms, h_prev + b * hidden, grad_a + at,
                         grad_u + at, hidden);
      terms.sums(b);
      if (terms.local()) terms.rows(b);
    };
    // Padded rows: no gradient to the terms; dh passes on as it is (their recurrent gradient is zero).
    clear_padded_rows<T>(m, rows, gates, {grad_a, grad_in, grad_rec});
    over_real_rows(rows, gates, m, gate_rows);
    if (!terms.local()) {
      terms.finish(count);
      over_real_rows(rows, gates, m, [&](int64_t b) { terms.rows(b); });
    }
    // dh holds the carry dh z (dh on padded rows).
    back(grad_step, dh_next, &dh);
    recurrent_grad.done(t);
    input_grad.done(t);
    if (t > 0) dh_next.add_(grad_out[t - 1]);
    std::swap(dh, dh_next);
  }
  const auto ih_grads = norm_ih->parameter_grads();
  const auto hh_grads = norm_hh->parameter_grads();
  return {projection.defined() ? projection.grad_x : grad_inputs,
          dh,
          grad_weight_hh,
          ih_grads.first,
          ih_grads.second,
          hh_grads.first,
          hh_grads.second,
          projection.grad_weight};
}

// ---- one step without gradients (generation) -------------------------------------------------------------------

// h' (and c' for an LSTM, else undefined) after one step at time index `step`, each (1, B, H) as a layer's state
// slice; x is (B, I) or (1, B, I), h and c (1, B, H). The norms' shifts carry the cell's biases. The weights come
// as W_ih^T and W_hh^T in the layout the caller prepared (seqnorm/layers/compiled.py's LayoutChoice).
// (The slices and the results' shapes are taken here: each is a Python call's worth of time in a step of ~20 us.)
template <typename T>
std::tuple<at::Tensor, at::Tensor> generation_step(const std::string& cell, const at::Tensor& x_in,
                                                   const at::Tensor& h_in, const c10::optional<at::Tensor>& c_in,
                                                   const at::Tensor& weight_ih_t, const at::Tensor& weight_hh_t,
                                                   const NormArgs& ih_args, const NormArgs& hh_args,
                                                   const NormArgs& c_args, int64_t step) {
  const at::Tensor x = (x_in.dim() == 3 ? x_in.select(0, 0) : x_in).contiguous();
  const at::Tensor h = h_in.select(0, 0).contiguous();
  const int64_t rows = x.size(0), gates = weight_hh_t.size(1), hidden = weight_hh_t.size(0);
  const auto options = x.options();
  at::Tensor input = at::mm(x, weight_ih_t);
  at::Tensor recurrent = at::mm(h, weight_hh_t);
  auto norm_ih = make_norm<T>(ih_args, 1, rows, gates, options, {}, step);
  auto norm_hh = make_norm<T>(hh_args, 1, rows, gates, options, {}, step);
  // Scratch, uninitialized: no tensors beyond the results (a step is a few microseconds). A norm's output goes to
  // its own block, never over its input (StepNorm::forward_row: out may be the addend, not x).
  const auto scratch = [](int64_t size) { return std::unique_ptr<T[]>(new T[size]); };
  const auto acts = scratch(rows * gates), terms = scratch(rows * gates);
  at::Tensor h_new = at::empty({1, rows, hidden}, options);
  if (cell == "gru") {  // N_ih(W_ih x) into `terms`, N_hh(W_hh h) into `u`
    const auto u = scratch(rows * gates);
    const GruStep<T> data{ptr<T>(input), ptr<T>(recurrent), terms.get(), u.get(), acts.get(), ptr<T>(h_new),
                          ptr<T>(h)};
    gru_step(*norm_ih, *norm_hh, 0, data, nullptr, rows, rows, hidden);
    return {h_new, at::Tensor()};
  }
  // LSTM: the step's pieces as in the training forward; the pre-activations go to `terms` (N_ih(W_ih x) first, then
  // N_hh(W_hh h) added to it there: output == addend).
  const at::Tensor c = c_in->select(0, 0).contiguous();
  auto norm_c = make_norm<T>(c_args, 1, rows, hidden, options, {}, step);
  at::Tensor c_new = at::empty({1, rows, hidden}, options);
  const auto c_out = norm_c->identity() ? nullptr : scratch(rows * hidden), tanh_c = scratch(rows * hidden);
  const LstmStep<T> data{ptr<T>(input),
                         ptr<T>(recurrent),
                         terms.get(),
                         acts.get(),
                         ptr<T>(c),
                         ptr<T>(c_new),
                         c_out.get(),
                         tanh_c.get(),
                         ptr<T>(h_new),
                         ptr<T>(h)};
  lstm_step(*norm_ih, *norm_hh, *norm_c, 0, data, nullptr, rows, rows, hidden);
  return {h_new, c_new};
}

// A step's (B,) mask as the (1, B) mask of a one-step sequence.
c10::optional<at::Tensor> one_step(const c10::optional<at::Tensor>& mask, int64_t rows) {
  if (!mask.has_value() || !mask->defined()) return c10::nullopt;
  return mask->view({1, rows});
}

// One norm's step alone (a cell's step in a loop of the user's own: the norm's forward_step), from the norm's pieces:
// y = γ N(x) + shift over x (B, F), its running statistics updated in place in training; the backward over the real
// rows (padded rows get no gradient, as the cells keep their state).
template <typename T>
std::tuple<at::Tensor, Tensors> norm_step_forward(const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                                                  const NormArgs& norm, int64_t step) {
  const int64_t rows = x.size(0), features = x.size(1);
  const Padding padding(one_step(mask, rows), 1, rows);
  auto built = make_norm<T>(norm, 1, rows, features, x.options(), {}, step);
  at::Tensor y = at::empty_like(x);
  built->forward(0, x.data_ptr<T>(), y.data_ptr<T>(), nullptr, padding.mask(0), padding.count(0));
  return {y, built->saved(false)};
}

template <typename T>
Tensors norm_step_backward(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                           const NormArgs& norm, const Tensors& saved, int64_t step) {
  const int64_t rows = x.size(0), features = x.size(1);
  const Padding padding(one_step(mask, rows), 1, rows);
  auto built = make_norm<T>(norm, 1, rows, features, x.options(), saved, step);
  const bool* m = padding.mask(0);
  const int64_t count = padding.count(0);
  const T* g = dy.data_ptr<T>();
  const T* in = x.data_ptr<T>();
  at::Tensor dx = at::zeros_like(x);
  T* out = dx.data_ptr<T>();
  built->recompute_stats(0, in, m, count);
  for (int64_t b = 0; b < rows; ++b) {  // the sums in row order, on this thread: the same on every run
    if (m == nullptr || m[b]) built->backward_sums(0, b, g + b * features, in + b * features);
  }
  built->finish_sums(0, count);
  over_real_rows(rows, features, m, [&](int64_t b) {
    built->backward_row(0, b, g + b * features, in + b * features, out + b * features);
  });
  auto [weight_grad, shift_grad] = built->parameter_grads();
  return {dx, weight_grad, shift_grad};
}

}  // namespace

// ---- the entry points: each dtype's time loop (the bindings, bindings.cpp, check the arguments first) ----------

Forward run_lstm_forward(const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0,
                         const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask, const NormArgs& ih,
                         const NormArgs& hh, const NormArgs& c, bool save) {
  return AT_DISPATCH_FLOATING_TYPES(inputs.scalar_type(), "seqnorm_lstm_forward", [&] {
    return lstm_forward<scalar_t>(inputs, h0, c0, weight_hh, mask, ih, hh, c, save);
  });
}

Tensors run_lstm_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& grad_c_n,
                          const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0,
                          const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask, const at::Tensor& hs,
                          const Tensors& saved, const c10::optional<at::Tensor>& raw,
                          const std::vector<Tensors>& stats, const NormArgs& ih, const NormArgs& hh,
                          const NormArgs& c, const c10::optional<at::Tensor>& sequence,
                          const c10::optional<at::Tensor>& weight_ih, bool want_x, bool want_weight) {
  return AT_DISPATCH_FLOATING_TYPES(grad_hs.scalar_type(), "seqnorm_lstm_backward", [&] {
    return lstm_backward<scalar_t>(grad_hs, grad_h_n, grad_c_n, inputs, h0, c0, weight_hh, mask, hs, saved, raw, stats,
                                   ih, hh, c, Projection(sequence, weight_ih, want_x, want_weight));
  });
}

Forward run_gru_forward(const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& weight_hh,
                        const c10::optional<at::Tensor>& mask, const NormArgs& ih, const NormArgs& hh, bool save) {
  return AT_DISPATCH_FLOATING_TYPES(inputs.scalar_type(), "seqnorm_gru_forward", [&] {
    return gru_forward<scalar_t>(inputs, h0, weight_hh, mask, ih, hh, save);
  });
}

Tensors run_gru_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& inputs,
                         const at::Tensor& h0, const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask,
                         const at::Tensor& hs, const Tensors& saved, const std::vector<Tensors>& stats,
                         const NormArgs& ih, const NormArgs& hh, const c10::optional<at::Tensor>& sequence,
                         const c10::optional<at::Tensor>& weight_ih, bool want_x, bool want_weight) {
  return AT_DISPATCH_FLOATING_TYPES(grad_hs.scalar_type(), "seqnorm_gru_backward", [&] {
    return gru_backward<scalar_t>(grad_hs, grad_h_n, inputs, h0, weight_hh, mask, hs, saved, stats, ih, hh,
                                  Projection(sequence, weight_ih, want_x, want_weight));
  });
}

std::tuple<at::Tensor, at::Tensor> run_generation_step(const std::string& cell, const at::Tensor& x,
                                                       const at::Tensor& h, const c10::optional<at::Tensor>& c,
                                                       const at::Tensor& weight_ih_t, const at::Tensor& weight_hh_t,
                                                       const NormArgs& ih, const NormArgs& hh,
                                                       const NormArgs& c_norm, int64_t step) {
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "seqnorm_generation_step", [&] {
    return generation_step<scalar_t>(cell, x, h, c, weight_ih_t, weight_hh_t, ih, hh, c_norm, step);
  });
}

std::tuple<at::Tensor, Tensors> run_norm_step_forward(const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                                                      const NormArgs& norm, int64_t step) {
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "seqnorm_norm_step_forward", [&] {
    return norm_step_forward<scalar_t>(x, mask, norm, step);
  });
}

Tensors run_norm_step_backward(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                               const NormArgs& norm, const Tensors& saved, int64_t step) {
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "seqnorm_norm_step_backward", [&] {
    return norm_step_backward<scalar_t>(dy, x, mask, norm, saved, step);
  });
}

}  // namespace seqnorm
