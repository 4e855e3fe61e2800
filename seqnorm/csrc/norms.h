// The norms of the recurrence, one step at a time: y = γ N(x) + shift (+ an addend), and their backward.
//
// Each norm owns its statistics and their backward here, once for the kernels (the Python modules in seqnorm/norms
// are the reference these are tested against; a module declares the "kernel" form and what it needs in
// `kernel_norm()`): LayerNorm and RMSNorm per row, per-timestep BatchNorm (and batch renormalization) per feature
// over the real rows of the step, with its running statistics updated in place exactly as the module's forward does.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "checks.h"
#include "vec.h"

namespace seqnorm {

// What a Python norm hands the kernels (`seqnorm.kernels.KernelNorm`): its kind, options and tensors.
struct NormArgs {
  std::string kind;  // "none" | "layer" | "rms" | "batch"
  double eps = 1e-5;
  c10::optional<at::Tensor> weight, shift;
  // Per-timestep BatchNorm: running moments (R, F), batches seen per row (R,) int64, updated in place in training.
  c10::optional<at::Tensor> running_mean, running_var, num_batches_tracked;
  double momentum = 0.1;  // < 0: cumulative average (momentum=None)
  bool training = false;
  // Batch renormalization (Ioffe 2017): the schedule of r_max and d_max in batches seen by a step's row.
  bool renorm = false;
  double r_max = 1.0, d_max = 0.0;
  int64_t warmup = 0, r_max_steps = 1, d_max_steps = 1;
  // Evaluation only, where nothing changes between calls (a generation step): per row of statistics the scale
  // γ / sqrt(var + ε) and the shift minus mean times that scale, (R, F), folded once by the module.
  c10::optional<at::Tensor> folded_scale, folded_offset;

  // No norm and no shift: the kernels pass the input on as it is (StepNorm::identity).
  bool identity() const { return kind == "none" && !Checks::given(shift); }

  // The one check of a norm's arguments, by every entry point for each norm it receives, before the norm is built:
  // the kind, the options, and each tensor against the `features` it normalizes (γ and shift (F,); per-timestep
  // BN's running moments (R, F), batches seen (R,) int64, and the folded rows (R, F), which only a generation step
  // (`generation`) is handed). `name` is the binding's argument ("ih"). In training BN's running statistics are
  // updated in place: they are marked so for the overlap check (Checks::apart).
  void validate(Checks& checks, const char* name, int64_t features, bool generation) const {
    const bool row = kind == "layer" || kind == "rms", batch = kind == "batch";
    SEQNORM_CHECK(checks, kind == "none" || row || batch, "expected ", name, ".kind none, layer, rms or batch, got '",
                  kind, "'");
    SEQNORM_CHECK(checks, std::isfinite(eps) && eps >= 0, "expected ", name, ".eps >= 0, got ", eps);
    const Shape vector{"(F,)", {features}};
    if (kind == "none") {
      checks.absent(weight, Name{name, "weight"}, "no norm has no γ");
    } else {
      checks.present(weight, Name{name, "weight"}, vector);
    }
    if (Checks::given(shift)) checks.tensor(*shift, Name{name, "shift"}, vector);
    const std::pair<const c10::optional<at::Tensor>*, const char*> statistics[] = {
        {&running_mean, "running_mean"}, {&running_var, "running_var"}, {&num_batches_tracked, "num_batches_tracked"},
        {&folded_scale, "folded_scale"}, {&folded_offset, "folded_offset"}};
    if (!batch) {
      for (const auto& [field, field_name] : statistics) {
        checks.absent(*field, Name{name, field_name}, "only per-timestep BatchNorm keeps statistics");
      }
      return;
    }
    SEQNORM_CHECK(checks, Checks::given(running_mean), "expected ", name,
                  ".running_mean of shape (R, F) (per-timestep BatchNorm's running statistics), got None");
    const int64_t rows = running_mean->dim() == 2 ? running_mean->size(0) : -1;
    SEQNORM_CHECK(checks, rows >= 1, "expected ", name, ".running_mean of shape (R, F) with R >= 1, got ",
                  shape_text(running_mean->sizes()));
    const Shape table{"(R, F)", {rows, features}};
    checks.present(running_mean, Name{name, "running_mean"}, table);
    checks.present(running_var, Name{name, "running_var"}, table);
    checks.present(num_batches_tracked, Name{name, "num_batches_tracked"}, Shape{"(R,)", {rows}}, true, at::kLong);
    if (training) {
      for (size_t i = 0; i < 3; ++i) checks.written(**statistics[i].first, Name{name, statistics[i].second});
    }
    SEQNORM_CHECK(checks, std::isfinite(momentum) && momentum <= 1, "expected ", name,
                  ".momentum <= 1 (< 0: a cumulative average), got ", momentum);
    SEQNORM_CHECK(checks, !renorm || (r_max >= 1 && d_max >= 0 && warmup >= 0 && r_max_steps >= 1 && d_max_steps >= 1),
                  "expected ", name, "'s renormalization r_max >= 1, d_max >= 0, warmup >= 0, r_max_steps >= 1, ",
                  "d_max_steps >= 1, got ", r_max, ", ", d_max, ", ", warmup, ", ", r_max_steps, ", ", d_max_steps);
    if (!Checks::given(folded_scale) && !Checks::given(folded_offset)) return;
    SEQNORM_CHECK(checks, generation, "expected ", name, ".folded_scale and folded_offset to be None (only a ",
                  "generation step reads folded statistics), got tensors");
    checks.present(folded_scale, Name{name, "folded_scale"}, table);
    checks.present(folded_offset, Name{name, "folded_offset"}, table);
  }

  // A backward's `saved` statistics of this norm (its forward's StepNorm::saved, in order) against the call's
  // `steps`, `rows` and `features`; `recomputing`: the backward recomputes BN's moments (a GRU's, which may keep none).
  void validate_saved(Checks& checks, const char* name, const std::vector<at::Tensor>& saved, int64_t steps,
                      int64_t rows, int64_t features, bool recomputing) const {
    const size_t want = kind == "none" ? 0 : kind == "batch" ? 5 : 2;
    SEQNORM_CHECK(checks, saved.size() == want, "expected stats of ", name, " to hold ", want, " tensors (a ", kind,
                  " norm's saved statistics), got ", saved.size());
    if (kind == "layer" || kind == "rms") {
      checks.tensor(saved[0], Name{name, "saved means"}, Shape{"(T, B)", {steps, rows}}, false);
      checks.tensor(saved[1], Name{name, "saved rstds"}, Shape{"(T, B)", {steps, rows}}, false);
    } else if (kind == "batch") {
      const Shape table{"(T, F)", {steps, features}}, none{"(0,)", {0}};
      const bool kept = !recomputing || saved[0].numel() != 0;
      checks.tensor(saved[0], Name{name, "saved means"}, kept ? table : none, false);
      checks.tensor(saved[1], Name{name, "saved rstds"}, kept ? table : none, false);
      checks.tensor(saved[2], Name{name, "saved r"}, renorm ? table : none, false);
      checks.tensor(saved[3], Name{name, "saved d"}, renorm ? table : none, false);
      checks.tensor(saved[4], Name{name, "saved batch steps"}, Shape{"(T,)", {steps}}, false, at::kBool);
    }
  }
};

template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<T>() : nullptr;
}

// The row norms' statistics (a few values per row) live in plain vectors while a call runs (a generation step
// allocates no tensors for them) and become tensors only to be saved for the backward; per-timestep BN's, a row of
// features per step, are tensors from the start (BatchStepNorm).
template <typename U>
at::Tensor to_tensor(const std::vector<U>& values, std::vector<int64_t> shape, const at::TensorOptions& options) {
  at::Tensor tensor = at::empty(shape, options);
  std::copy(values.begin(), values.end(), static_cast<U*>(tensor.data_ptr()));
  return tensor;
}

template <typename U>
std::vector<U> from_tensor(const at::Tensor& tensor) {
  const at::Tensor values = tensor.contiguous();
  const U* data = static_cast<const U*>(values.data_ptr());
  return std::vector<U>(data, data + values.numel());
}

template <typename T>
class StepNorm {
 public:
  StepNorm(const NormArgs& args, int64_t steps, int64_t rows, int64_t features, const at::TensorOptions& options)
      : args_(args), steps_(steps), rows_(rows), features_(features), options_(options),
        weight_(data_or_null<T>(args.weight)), shift_(data_or_null<T>(args.shift)) {}
  virtual ~StepNorm() = default;

  // The forward of step t in pieces, for a caller that runs them inside its own passes over the step's rows (a
  // cell's step takes each row from its terms to h' while it is in cache):
  //   forward_stats(t, x, mask, count)      before any row, with the step's whole block x (rows x features; `mask`
  //                                         marks the real rows, null: all `count`): statistics that span the rows
  //                                         (BN's, and its running statistics' update); nothing for a row norm
  //   forward_row(t, b, x, out, addend)     row b: out = γ N(x) + shift + addend (addend may be null; pointers at
  //                                         the row; out may be addend, never x: a norm may read x again after
  //                                         writing out); every row, padded or not, by any thread
  // row_local() (below) says whether forward_stats does anything.
  virtual void forward_stats(int64_t, const T*, const bool*, int64_t) {}
  virtual void forward_row(int64_t t, int64_t b, const T* x, T* out, const T* addend) = 0;

  // The whole step from those pieces: out = γ N(x) + shift + addend for step t's block (an LSTM without a
  // recurrent norm applies its input norm so, before the product adds W_hh h).
  void forward(int64_t t, const T* x, T* out, const T* addend, const bool* mask, int64_t count) {
    const int64_t f = features_;
    forward_stats(t, x, mask, count);
    over_rows(rows_, f, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        forward_row(t, b, x + b * f, out + b * f, addend == nullptr ? nullptr : addend + b * f);
      }
    });
  }

  // The forward's output again, for a backward that recomputes instead of keeping it (a GRU keeps W_ih x and W_hh h,
  // not its gates, and its norms keep no statistics they can compute again from those: saved(true)):
  //   recompute_stats(t, x, mask, count)   before any row of step t, with the step's block x as the forward saw it
  //                                        (BN: the step's moments, unless kept, then its scale and shift)
  //   normalized_row(t, b, x, out)         row b: out = γ N(x) + shift
  virtual void recompute_stats(int64_t, const T*, const bool*, int64_t) {}
  virtual void normalized_row(int64_t t, int64_t b, const T* x, T* out) = 0;

  // The backward of step t in pieces, for a caller that runs them inside its own passes over the step's rows (a
  // cell's backward takes each row from dh through every norm while it is in cache). Pointers are at row b:
  //   backward_sums(t, b, dy, x)    row b's share of the sums: its own (a row norm's) or the step's (BN's), and
  //                                 of the γ and shift gradients; called for every real row, by any thread
  //   finish_sums(t, count)         after every real row's sums, before any backward_row (statistics that span
  //                                 the rows; nothing for a row norm)
  //   backward_row(t, b, dy, x, dx) row b's dx
  // row_local(): statistics per row. forward_stats does nothing, and backward_row(t, b) needs the sums of row b
  // alone, so it may follow backward_sums(t, b) at once.
  virtual bool row_local() const { return true; }
  virtual void backward_sums(int64_t t, int64_t b, const T* dy, const T* x) = 0;
  virtual void finish_sums(int64_t, int64_t) {}
  virtual void backward_row(int64_t t, int64_t b, const T* dy, const T* x, T* dx) = 0;

  // What the backward needs, in the order the constructor for the backward takes it. `recomputing`: the backward
  // calls recompute_stats with every step's block, so statistics it can compute again need not be kept.
  virtual std::vector<at::Tensor> saved(bool recomputing) const = 0;
  // No norm and no shift: the output is the input itself.
  virtual bool identity() const { return false; }
  int64_t fallback_steps() const { return fallback_steps_; }

  // (dL/dγ, dL/dshift) after the backward, undefined where there is no γ or shift.
  virtual std::pair<at::Tensor, at::Tensor> parameter_grads() = 0;

 protected:
  // The rows of per-thread sums a backward needs: one per thread of its passes (a call from inside another parallel
  // region runs its passes on the calling thread, whatever its number).
  static int64_t thread_slots() { return std::max<int64_t>(at::get_num_threads(), at::get_thread_num() + 1); }

  // Each thread's own row of `width` sums (`partials`: one row per thread of the backward's parallel passes).
  static T* own(std::vector<T>& partials, int64_t width) {
    const int64_t thread = at::get_thread_num();
    TORCH_CHECK((thread + 1) * width <= static_cast<int64_t>(partials.size()), "seqnorm kernels: thread ", thread,
                " beyond the threads the norm was built for");
    return partials.data() + thread * width;
  }

  // out[j] = the sum over threads of `partials` (rows of `width`) in column offset + j, j < size.
  static void add_threads(const std::vector<T>& partials, int64_t width, int64_t offset, int64_t size, T* out) {
    std::fill(out, out + size, T(0));
    for (size_t row = 0; row * width < partials.size(); ++row) {
      const T* from = partials.data() + row * width + offset;
      for (int64_t j = 0; j < size; ++j) out[j] += from[j];
    }
  }

  // The same, as a tensor.
  at::Tensor thread_total(const std::vector<T>& partials, int64_t width, int64_t offset, int64_t size) const {
    at::Tensor total = at::empty({size}, options_);
    add_threads(partials, width, offset, size, total.data_ptr<T>());
    return total;
  }

  NormArgs args_;
  int64_t steps_, rows_, features_;
  at::TensorOptions options_;
  const T* weight_;
  const T* shift_;
  int64_t fallback_steps_ = 0;
};

// ---- no norm: out = x + shift + addend -------------------------------------------------------------------------

template <typename T>
class NoNorm final : public StepNorm<T> {
 public:
  NoNorm(const NormArgs& args, int64_t steps, int64_t rows, int64_t features, const at::TensorOptions& options)
      : StepNorm<T>(args, steps, rows, features, options) {
    if (this->shift_ != nullptr) partials_.assign(this->thread_slots() * features, T(0));
  }
  bool identity() const override { return this->shift_ == nullptr; }

  void forward_row(int64_t, int64_t, const T* x, T* out, const T* addend) override {
    vec_loop<T>(this->features_, [&](int64_t i, int64_t n) {
      Vec<T> y = load(x + i, n);
      if (this->shift_ != nullptr) y = y + load(this->shift_ + i, n);
      if (addend != nullptr) y = y + load(addend + i, n);
      store(y, out + i, n);
    });
  }

  void normalized_row(int64_t t, int64_t b, const T* x, T* out) override { forward_row(t, b, x, out, nullptr); }

  void backward_sums(int64_t, int64_t, const T* dy, const T*) override {
    if (this->shift_ == nullptr) return;
    T* grad = this->own(partials_, this->features_);
    vec_loop<T>(this->features_,
                [&](int64_t i, int64_t n) { store(load(grad + i, n) + load(dy + i, n), grad + i, n); });
  }
  void backward_row(int64_t, int64_t, const T* dy, const T*, T* dx) override {
    if (dx != dy) std::copy(dy, dy + this->features_, dx);
  }

  std::vector<at::Tensor> saved(bool) const override { return {}; }
  std::pair<at::Tensor, at::Tensor> parameter_grads() override {
    if (this->shift_ == nullptr) return {at::Tensor(), at::Tensor()};
    return {at::Tensor(), this->thread_total(partials_, this->features_, 0, this->features_)};
  }

 private:
  std::vector<T> partials_;  // per thread: dL/dshift
};

// ---- LayerNorm and RMSNorm: statistics per row -----------------------------------------------------------------

template <typename T>
class RowNorm final : public StepNorm<T> {
 public:
  // Forward: saved is empty (statistics are allocated for `steps`); backward: the forward's saved().
  RowNorm(const NormArgs& args, int64_t steps, int64_t rows, int64_t features, const at::TensorOptions& options,
          const std::vector<at::Tensor>& saved)
      : StepNorm<T>(args, steps, rows, features, options), centered_(args.kind == "layer") {
    if (saved.empty()) {
      means_.assign(steps * rows, T(0));
      rstds_.assign(steps * rows, T(0));
    } else {
      means_ = from_tensor<T>(saved.at(0));
      rstds_ = from_tensor<T>(saved.at(1));
      partials_.assign(this->thread_slots() * 2 * features, T(0));
      row_sums_.assign(2 * rows, T(0));
    }
  }

  void forward_row(int64_t t, int64_t b, const T* x, T* out, const T* addend) override {
    const int64_t f = this->features_;
    T mean = 0;
    if (centered_) {
      mean = vec_sums<T, 1>(f, [&](int64_t i, int64_t n, Vec<T>* sum) { sum[0] = sum[0] + load(x + i, n); })[0] /
             static_cast<T>(f);
    }
    const Vec<T> m(mean);
    const T squares = vec_sums<T, 1>(f, [&](int64_t i, int64_t n, Vec<T>* sum) {
      const Vec<T> d = only(load(x + i, n) - m, n);
      sum[0] = at::vec::fmadd(d, d, sum[0]);
    })[0];
    const T rstd = T(1) / std::sqrt(squares / static_cast<T>(f) + static_cast<T>(this->args_.eps));
    means_[t * this->rows_ + b] = mean;
    rstds_[t * this->rows_ + b] = rstd;
    apply(mean, rstd, x, out, addend);
  }

  void normalized_row(int64_t t, int64_t b, const T* x, T* out) override {
    apply(means_[t * this->rows_ + b], rstds_[t * this->rows_ + b], x, out, nullptr);
  }

  // x̂ = (x - mean) rstd, g = dy γ: dx = rstd (g - mean(g) - x̂ mean(g x̂)); dγ += Σ dy x̂, dshift += Σ dy.
  void backward_sums(int64_t t, int64_t b, const T* dy, const T* x) override {
    const int64_t f = this->features_;
    const Vec<T> m(means_[t * this->rows_ + b]), r(rstds_[t * this->rows_ + b]);
    T* dgamma = this->own(partials_, 2 * f);
    T* dshift = dgamma + f;
    const std::array<T, 2> sums = vec_sums<T, 2>(f, [&](int64_t i, int64_t n, Vec<T>* sum) {
      const Vec<T> d = load(dy + i, n);
      const Vec<T> x_hat = only((load(x + i, n) - m) * r, n);
      const Vec<T> g = d * load(this->weight_ + i, n);
      store(at::vec::fmadd(d, x_hat, load(dgamma + i, n)), dgamma + i, n);
      store(load(dshift + i, n) + d, dshift + i, n);
      sum[0] = sum[0] + g;
      sum[1] = at::vec::fmadd(g, x_hat, sum[1]);
    });
    row_sums_[2 * b] = sums[0];
    row_sums_[2 * b + 1] = sums[1];
  }

  void backward_row(int64_t t, int64_t b, const T* dy, const T* x, T* dx) override {
    const T inv_f = T(1) / static_cast<T>(this->features_);
    const Vec<T> m(means_[t * this->rows_ + b]), r(rstds_[t * this->rows_ + b]);
    const Vec<T> g_mean(centered_ ? row_sums_[2 * b] * inv_f : T(0)), gx_mean(row_sums_[2 * b + 1] * inv_f);
    vec_loop<T>(this->features_, [&](int64_t i, int64_t n) {
      const Vec<T> x_hat = (load(x + i, n) - m) * r;
      const Vec<T> g = load(dy + i, n) * load(this->weight_ + i, n);
      store((g - g_mean - x_hat * gx_mean) * r, dx + i, n);
    });
  }

  // A row's two values (kept: they are 1 / features of the block they would be recomputed from).
  std::vector<at::Tensor> saved(bool) const override {
    return {to_tensor(means_, {this->steps_, this->rows_}, this->options_),
            to_tensor(rstds_, {this->steps_, this->rows_}, this->options_)};
  }

  std::pair<at::Tensor, at::Tensor> parameter_grads() override {
    const int64_t f = this->features_;
    return {this->thread_total(partials_, 2 * f, 0, f),
            this->shift_ != nullptr ? this->thread_total(partials_, 2 * f, f, f) : at::Tensor()};
  }

 private:
  // out = (x - mean) rstd γ + shift (+ addend) for one row.
  void apply(T mean, T rstd, const T* x, T* out, const T* addend) const {
    const Vec<T> m(mean), r(rstd);
    vec_loop<T>(this->features_, [&](int64_t i, int64_t n) {
      Vec<T> y = (load(x + i, n) - m) * r * load(this->weight_ + i, n);
      if (this->shift_ != nullptr) y = y + load(this->shift_ + i, n);
      if (addend != nullptr) y = y + load(addend + i, n);
      store(y, out + i, n);
    });
  }

  bool centered_;
  std::vector<T> means_, rstds_;
  std::vector<T> partials_;  // per thread: dγ, dshift (2F)
  std::vector<T> row_sums_;  // per row of the step: Σ g, Σ g x̂
};

// ---- per-timestep BatchNorm (and batch renormalization): statistics per feature over the real rows ---------------

template <typename T>
class BatchStepNorm final : public StepNorm<T> {
 public:
  BatchStepNorm(const NormArgs& args, int64_t steps, int64_t rows, int64_t features,
                const at::TensorOptions& options, const std::vector<at::Tensor>& saved, int64_t first_step)
      : StepNorm<T>(args, steps, rows, features, options), first_step_(first_step) {
    TORCH_CHECK(first_step >= 0, "seqnorm kernels: expected a time index >= 0, got ", first_step);
    if (!args.training && args.folded_scale.has_value()) return;  // folded: forward reads nothing else (generation)
    // The statistics of every step are tensors from the start (unlike the row norms' few per-row values): saving
    // them copies nothing, and each fresh buffer is touched once. As vectors copied into tensors to be saved and
    // back in the backward, their page faults and copies took over a quarter of a BN-LSTM's forward
    // (docs/performance.md). r and d exist per step only for batch renormalization; plain BN reads one shared row of
    // 1 and 0.
    if (saved.empty()) {
      means_ = at::empty({steps, features}, options);  // every step writes its row before anything reads it
      rstds_ = at::empty({steps, features}, options);
      if (args.renorm) {
        rs_ = at::ones({steps, features}, options);  // steps on running statistics keep r = 1, d = 0
        ds_ = at::zeros({steps, features}, options);
      }
      batch_steps_.assign(steps, 0);
    } else {
      // No moments kept (saved(true), every step on batch statistics): recompute_stats fills each step's row.
      recomputing_ = saved.at(0).numel() == 0;
      means_ = recomputing_ ? at::empty({steps, features}, options) : saved.at(0).contiguous();
      rstds_ = recomputing_ ? at::empty({steps, features}, options) : saved.at(1).contiguous();
      if (args.renorm) {
        rs_ = saved.at(2).contiguous();
        ds_ = saved.at(3).contiguous();
      }
      batch_steps_ = from_tensor<uint8_t>(saved.at(4));
      weight_grad_ = at::zeros({features}, options);
      shift_grad_ = at::zeros({features}, options);
      partials_.assign(this->thread_slots() * 2 * features, T(0));
      sums_.assign(2 * features, T(0));
    }
    if (!args.renorm) {
      no_r_.assign(features, T(1));
      no_d_.assign(features, T(0));
    }
    scale_.assign(features, T(0));
    offset_.assign(features, T(0));
  }

  // The step's mean and rstd (and r, d) over its real rows, or its running statistics; the running statistics
  // updated; then the step's scale and shift per feature, which forward_row applies.
  void forward_stats(int64_t t, const T* x, const bool* mask, int64_t count) override {
    const NormArgs& a = this->args_;
    const int64_t f = this->features_, rows = this->rows_;
    // Steps at or beyond max_steps share the last row of statistics.
    const int64_t row = std::min<int64_t>(first_step_ + t, a.running_mean->size(0) - 1);
    T* running_mean = a.running_mean->data_ptr<T>() + row * f;
    T* running_var = a.running_var->data_ptr<T>() + row * f;
    int64_t* tracked = a.num_batches_tracked->data_ptr<int64_t>() + row;
    if (!a.training && a.folded_scale.has_value()) {
      // Evaluation with the statistics folded once into a scale and shift per row (a generation step).
      step_scale_ = a.folded_scale->data_ptr<T>() + row * f;
      step_shift_ = a.folded_offset->data_ptr<T>() + row * f;
      return;
    }
    T* mean = means_.data_ptr<T>() + t * f;
    T* rstd = rstds_.data_ptr<T>() + t * f;
    T* r = r_row(t);
    T* d = d_row(t);
    const T eps = static_cast<T>(a.eps);
    // Fewer than 2 real rows in training: the step's running statistics, not updated (the module's fallback).
    const bool use_batch = a.training && count >= 2;
    batch_steps_[t] = use_batch;
    if (a.training && !use_batch) ++this->fallback_steps_;
    if (use_batch) {
      // Ioffe's limits from the updates this row has seen before this step, in T as the module computes them.
      const T seen = static_cast<T>(std::max<int64_t>(*tracked - a.warmup, 0));
      const T r_max = T(1) + static_cast<T>(a.r_max - 1.0) * std::min(seen / static_cast<T>(a.r_max_steps), T(1));
      const T d_max = static_cast<T>(a.d_max) * std::min(seen / static_cast<T>(a.d_max_steps), T(1));
      // The k-th batch of a row weighs 1/k under a cumulative average.
      const T weight = a.momentum < 0 ? T(1) / static_cast<T>(*tracked + 1) : static_cast<T>(a.momentum);
      const T unbias = static_cast<T>(count) / static_cast<T>(count - 1);
      moment_sums(x, mask, count, mean, rstd);
      const Vec<T> one(T(1)), epsilon(eps), unbiased(unbias);
      const Vec<T> r_high(r_max), r_low(T(1) / r_max);
      const Vec<T> d_high(d_max), d_low(-d_max);
      vec_loop<T>(f, [&](int64_t j, int64_t n) {
        const Vec<T> m = load(mean + j, n);
        Vec<T> var;
        const Vec<T> s = finish_moments(rstd + j, n, count, var);
        store(s, rstd + j, n);
        const Vec<T> run_mean = load(running_mean + j, n), run_var = load(running_var + j, n);
        if (a.renorm) {
          const Vec<T> run_rstd = one / (run_var + epsilon).sqrt();  // before this step's update
          store(at::vec::minimum(at::vec::maximum(run_rstd / s, r_low), r_high), r + j, n);
          store(at::vec::minimum(at::vec::maximum((m - run_mean) * run_rstd, d_low), d_high), d + j, n);
        }
        store(lerp(run_mean, m, weight), running_mean + j, n);
        store(lerp(run_var, var * unbiased, weight), running_var + j, n);
      });
      *tracked += 1;
    } else {
      std::copy(running_mean, running_mean + f, mean);
      const Vec<T> one(T(1)), epsilon(eps);
      vec_loop<T>(f, [&](int64_t i, int64_t n) {
        store(one / (load(running_var + i, n) + epsilon).sqrt(), rstd + i, n);
      });
    }
    prepare(t);
  }

  // out = x scale + shift (+ addend) with forward_stats' scale and shift of the step.
  void forward_row(int64_t, int64_t, const T* x, T* out, const T* addend) override {
    vec_loop<T>(this->features_, [&](int64_t i, int64_t n) {
      Vec<T> y = at::vec::fmadd(load(x + i, n), load(step_scale_ + i, n), load(step_shift_ + i, n));
      if (addend != nullptr) y = y + load(addend + i, n);
      store(y, out + i, n);
    });
  }

  // The step's moments again from x when the forward kept none (the same sums, in the same order, as forward_stats:
  // the same values), then its scale and shift.
  void recompute_stats(int64_t t, const T* x, const bool* mask, int64_t count) override {
    if (recomputing_) {
      const int64_t f = this->features_;
      T* mean = means_.data_ptr<T>() + t * f;
      T* rstd = rstds_.data_ptr<T>() + t * f;
      moment_sums(x, mask, count, mean, rstd);
      vec_loop<T>(f, [&](int64_t j, int64_t n) {
        Vec<T> var;
        store(finish_moments(rstd + j, n, count, var), rstd + j, n);
      });
    }
    prepare(t);
  }

  void normalized_row(int64_t t, int64_t b, const T* x, T* out) override { forward_row(t, b, x, out, nullptr); }

  // Statistics over the step's rows: every row's sums come before any row's dx.
  bool row_local() const override { return false; }

  // Σ dy and Σ dy x̂ per feature over the real rows, each thread its own (merged by finish_sums).
  void backward_sums(int64_t t, int64_t, const T* dy, const T* x) override {
    const int64_t f = this->features_;
    const T* mean = means_.data_ptr<T>() + t * f;
    const T* rstd = rstds_.data_ptr<T>() + t * f;
    T* dy_sum = this->own(partials_, 2 * f);
    T* dyx_sum = dy_sum + f;
    vec_loop<T>(f, [&](int64_t i, int64_t n) {
      const Vec<T> g = load(dy + i, n);
      const Vec<T> x_hat = (load(x + i, n) - load(mean + i, n)) * load(rstd + i, n);
      store(load(dy_sum + i, n) + g, dy_sum + i, n);
      store(at::vec::fmadd(g, x_hat, load(dyx_sum + i, n)), dyx_sum + i, n);
    });
  }

  // dγ = Σ dy (x̂ r + d), dshift = Σ dy; the step's sums kept for backward_row, the threads' zeroed for the next.
  void finish_sums(int64_t t, int64_t count) override {
    const int64_t f = this->features_;
    const T* r = r_row(t);
    const T* d = d_row(t);
    T* weight_grad = weight_grad_.data_ptr<T>();
    T* shift_grad = shift_grad_.data_ptr<T>();
    T* dy_sum = sums_.data();
    const T* dyx_sum = dy_sum + f;
    this->add_threads(partials_, 2 * f, 0, 2 * f, dy_sum);
    std::fill(partials_.begin(), partials_.end(), T(0));
    for (int64_t j = 0; j < f; ++j) {
      weight_grad[j] += dyx_sum[j] * r[j] + dy_sum[j] * d[j];
      shift_grad[j] += dy_sum[j];
    }
    inv_count_ = T(1) / static_cast<T>(std::max<int64_t>(count, 1));
  }

  // With batch statistics dx = γ r rstd (dy - Σdy / n - x̂ Σ dy x̂ / n); with running statistics (constants)
  // dx = γ rstd dy.
  void backward_row(int64_t t, int64_t, const T* dy, const T* x, T* dx) override {
    const int64_t f = this->features_;
    const T* mean = means_.data_ptr<T>() + t * f;
    const T* rstd = rstds_.data_ptr<T>() + t * f;
    const T* r = r_row(t);
    const T* dy_sum = sums_.data();
    const T* dyx_sum = dy_sum + f;
    const bool batch_step = batch_steps_[t];
    const Vec<T> c(inv_count_);
    vec_loop<T>(f, [&](int64_t i, int64_t n) {
      const Vec<T> s = load(rstd + i, n) * load(this->weight_ + i, n);
      Vec<T> g = load(dy + i, n);
      if (batch_step) {
        const Vec<T> x_hat = (load(x + i, n) - load(mean + i, n)) * load(rstd + i, n);
        g = (g - load(dy_sum + i, n) * c - x_hat * load(dyx_sum + i, n) * c) * load(r + i, n);
      }
      store(g * s, dx + i, n);
    });
  }

  // The moments (none when the backward recomputes them and every step had batch statistics: a step on running
  // statistics read buffers that have changed since), r and d (batch renormalization: they came from the running
  // statistics before this step's update), which steps had batch statistics.
  std::vector<at::Tensor> saved(bool recomputing) const override {
    const at::Tensor none = at::empty({0}, this->options_);  // plain BN: r = 1, d = 0, nothing to keep
    const bool keep = !recomputing || std::find(batch_steps_.begin(), batch_steps_.end(), 0) != batch_steps_.end();
    return {keep ? means_ : none, keep ? rstds_ : none, this->args_.renorm ? rs_ : none,
            this->args_.renorm ? ds_ : none, to_tensor(batch_steps_, {this->steps_}, this->options_.dtype(at::kBool))};
  }

  std::pair<at::Tensor, at::Tensor> parameter_grads() override {
    return {weight_grad_, this->shift_ != nullptr ? shift_grad_ : at::Tensor()};
  }

 private:
  // torch.lerp's formula (the module updates its running moments with it).
  static Vec<T> lerp(const Vec<T>& start, const Vec<T>& end, T weight) {
    return weight < T(0.5) ? start + Vec<T>(weight) * (end - start) : end - (end - start) * Vec<T>(T(1) - weight);
  }

  // Per block of features (split between threads), sums over the real rows held in registers: the mean into `mean`,
  // then the squares of the deviations from it into `squares` (finish_moments turns them into rstd).
  void moment_sums(const T* x, const bool* mask, int64_t count, T* mean, T* squares) const {
    const int64_t f = this->features_, rows = this->rows_;
    constexpr int64_t width = Vec<T>::size();
    const Vec<T> inv_count(T(1) / static_cast<T>(count));
    feature_blocks<T>(rows, f, [&](int64_t j, int64_t vectors, const int64_t* counts) {
      Vec<T> sums[kBlockVectors], squared[kBlockVectors];
      for (int64_t v = 0; v < vectors; ++v) {
        sums[v] = Vec<T>(T(0));
        squared[v] = Vec<T>(T(0));
      }
      for (int64_t b = 0; b < rows; ++b) {
        if (mask != nullptr && !mask[b]) continue;
        for (int64_t v = 0; v < vectors; ++v) sums[v] = sums[v] + load(x + b * f + j + v * width, counts[v]);
      }
      for (int64_t v = 0; v < vectors; ++v) sums[v] = sums[v] * inv_count;
      for (int64_t b = 0; b < rows; ++b) {
        if (mask != nullptr && !mask[b]) continue;
        for (int64_t v = 0; v < vectors; ++v) {
          const Vec<T> centered = load(x + b * f + j + v * width, counts[v]) - sums[v];
          squared[v] = at::vec::fmadd(centered, centered, squared[v]);
        }
      }
      for (int64_t v = 0; v < vectors; ++v) {
        store(sums[v], mean + j + v * width, counts[v]);
        store(squared[v], squares + j + v * width, counts[v]);
      }
    });
  }

  // The biased variance (into `var`) and rstd of the n features at `squares` (moment_sums' sums of squares).
  Vec<T> finish_moments(const T* squares, int64_t n, int64_t count, Vec<T>& var) const {
    var = load(squares, n) / Vec<T>(static_cast<T>(count));
    return Vec<T>(T(1)) / (var + Vec<T>(static_cast<T>(this->args_.eps))).sqrt();
  }

  // Step t's scale γ rstd r and shift γ d - mean γ rstd r + shift per feature, what forward_row applies:
  // y = x scale + shift = (x - mean) rstd γ r + γ d + shift.
  void prepare(int64_t t) {
    const int64_t f = this->features_;
    const T* mean = means_.data_ptr<T>() + t * f;
    const T* rstd = rstds_.data_ptr<T>() + t * f;
    const T* r = r_row(t);
    const T* d = d_row(t);
    T* scale = scale_.data();
    T* shifted = offset_.data();
    vec_loop<T>(f, [&](int64_t i, int64_t n) {
      const Vec<T> w = load(this->weight_ + i, n);
      const Vec<T> sc = load(rstd + i, n) * w * load(r + i, n);
      Vec<T> sh = w * load(d + i, n) - load(mean + i, n) * sc;
      if (this->shift_ != nullptr) sh = sh + load(this->shift_ + i, n);
      store(sc, scale + i, n);
      store(sh, shifted + i, n);
    });
    step_scale_ = scale;
    step_shift_ = shifted;
  }

  // Batch renormalization's r and d of step t, or plain BN's shared row of 1 and 0.
  T* r_row(int64_t t) { return this->args_.renorm ? rs_.data_ptr<T>() + t * this->features_ : no_r_.data(); }
  T* d_row(int64_t t) { return this->args_.renorm ? ds_.data_ptr<T>() + t * this->features_ : no_d_.data(); }

  int64_t first_step_;  // the time index of step 0 (a generation step's own index)
  at::Tensor means_, rstds_, rs_, ds_;  // (steps, F); rs_ and ds_ only for batch renormalization
  bool recomputing_ = false;            // the backward: means_ and rstds_ filled by recompute_stats
  std::vector<T> no_r_, no_d_;          // plain BN's r = 1 and d = 0 (F)
  std::vector<uint8_t> batch_steps_;  // whether a step used batch statistics
  at::Tensor weight_grad_, shift_grad_;
  std::vector<T> scale_, offset_;  // the step's scale and shift (forward_stats, recompute_stats)
  const T* step_scale_ = nullptr;  // what forward_row applies: scale_ and offset_, or the folded rows
  const T* step_shift_ = nullptr;
  std::vector<T> sums_;            // the backward: the step's Σ dy, Σ dy x̂ (2F)
  std::vector<T> partials_;        // per thread of the backward: Σ dy, Σ dy x̂ of the step so far (2F)
  T inv_count_ = T(1);             // the backward: 1 / the step's real rows
};

template <typename T>
std::unique_ptr<StepNorm<T>> make_norm(const NormArgs& args, int64_t steps, int64_t rows, int64_t features,
                                       const at::TensorOptions& options, const std::vector<at::Tensor>& saved,
                                       int64_t first_step = 0) {
  if (args.kind == "none") return std::make_unique<NoNorm<T>>(args, steps, rows, features, options);
  if (args.kind == "layer" || args.kind == "rms") {
    return std::make_unique<RowNorm<T>>(args, steps, rows, features, options, saved);
  }
  if (args.kind == "batch") {
    return std::make_unique<BatchStepNorm<T>>(args, steps, rows, features, options, saved, first_step);
  }
  TORCH_CHECK(false, "seqnorm kernels: unknown norm kind '", args.kind, "'");
}

}  // namespace seqnorm
