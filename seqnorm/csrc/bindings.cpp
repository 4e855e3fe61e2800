// The kernels' Python bindings (pybind11): the checked entry points of the time loops (recurrence.cpp) and of the
// memory, product-route and trial helpers (buffers.h, product.h), so that recurrence.cpp reads as the loops alone.
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "buffers.h"
#include "checks.h"
#include "norms.h"
#include "product.h"
#include "recurrence.h"

// ---- bindings: argument checks, dtype dispatch -------------------------------------------------------------------
//
// Every binding checks all its arguments (checks.h) before it reads or writes their memory: cell, dtypes (float32 or
// float64, one per call), CPU, contiguity where rows are indexed densely, every shape against the others, the
// optional tensors the cell and norms need, and each norm (NormArgs::validate).
//
// Aliasing: every result is a fresh tensor, never one of the arguments nor a view of one. The only arguments
// written are a per-timestep BatchNorm's running_mean, running_var and num_batches_tracked in training (the
// forwards, the norm step and the generation step update them in place, as the module's forward does); they may
// share no memory with one another or with any other argument (checked). Everything else is read only. Inside a
// call, a norm's output may be written over its addend (the LSTM's N_hh(W_hh h) added to N_ih(W_ih x) where it
// lies), never over its own input (StepNorm::forward_row).

namespace {

using seqnorm::Checks;
using seqnorm::Name;
using seqnorm::NormArgs;
using seqnorm::Shape;
using seqnorm::Forward;
using seqnorm::Tensors;

// The checks of a recurrence's entry points (one direction's forward or backward): T and B from `first` (inputs
// (T, B, G) or grad_hs (T, B, H)), H from W_hh (G, H), G = 4H for an LSTM, 3H for a GRU.
class Recurrence : public Checks {
 public:
  Recurrence(const char* entry, bool lstm, const at::Tensor& first, const char* first_name,
             const at::Tensor& weight_hh)
      : Checks(entry, first, Name{first_name}), lstm_(lstm) {
    SEQNORM_CHECK(*this, first.dim() == 3 && first.size(0) >= 1, "expected ", first_name,
                  " of shape (T, B, .) with T >= 1, got ", seqnorm::shape_text(first.sizes()));
    SEQNORM_CHECK(*this, weight_hh.dim() == 2 && weight_hh.size(1) >= 1, "expected weight_hh of shape ",
                  lstm ? "(4H, H)" : "(3H, H)", " with H >= 1, got ", seqnorm::shape_text(weight_hh.sizes()));
    steps = first.size(0);
    rows = first.size(1);
    hidden = weight_hh.size(1);
    gates = (lstm ? 4 : 3) * hidden;
    tensor(weight_hh, Name{"weight_hh"}, Shape{lstm ? "(4H, H)" : "(3H, H)", {gates, hidden}}, false);
  }

  Shape terms() const { return {lstm_ ? "(T, B, 4H)" : "(T, B, 3H)", {steps, rows, gates}}; }
  Shape states() const { return {"(T, B, H)", {steps, rows, hidden}}; }
  Shape state() const { return {"(B, H)", {rows, hidden}}; }

  // The padding mask, (T, B) bool where given.
  void mask(const c10::optional<at::Tensor>& mask) {
    if (given(mask)) tensor(*mask, Name{"mask"}, Shape{"(T, B)", {steps, rows}}, false, at::kBool);
  }

  // The norms: the input and recurrent norms on G features, the LSTM's cell-state norm on H.
  void norms(const NormArgs& ih, const NormArgs& hh, const NormArgs* c = nullptr) {
    ih.validate(*this, "ih", gates, false);
    hh.validate(*this, "hh", gates, false);
    if (c != nullptr) c->validate(*this, "c", hidden, false);
  }

  // The input projection's x (T, B, I) and W_ih (G, I), handed over together and only with an input norm.
  void projection(const c10::optional<at::Tensor>& sequence, const c10::optional<at::Tensor>& weight_ih,
                  const NormArgs& ih) {
    if (!given(sequence) && !given(weight_ih)) return;
    SEQNORM_CHECK(*this, given(sequence) && given(weight_ih), "expected sequence and weight_ih both or neither ",
                  "(the input projection's x and W_ih), got only ", given(sequence) ? "sequence" : "weight_ih");
    SEQNORM_CHECK(*this, !ih.identity(), "expected sequence and weight_ih only with an input norm (ih), got ih of ",
                  "kind none");
    SEQNORM_CHECK(*this, weight_ih->dim() == 2, "expected weight_ih of shape ", lstm_ ? "(4H, I)" : "(3H, I)",
                  ", got ", seqnorm::shape_text(weight_ih->sizes()));
    const int64_t features = weight_ih->size(1);
    tensor(*weight_ih, Name{"weight_ih"}, Shape{lstm_ ? "(4H, I)" : "(3H, I)", {gates, features}}, false);
    tensor(*sequence, Name{"sequence"}, Shape{"(T, B, I)", {steps, rows, features}}, false);
  }

  // The saved statistics of the backward: one list per norm, as the forward returned them.
  void saved_stats(const std::vector<Tensors>& stats, const NormArgs& ih, const NormArgs& hh, const NormArgs* c,
                   bool recomputing) {
    const size_t want = c != nullptr ? 3 : 2;
    SEQNORM_CHECK(*this, stats.size() == want, "expected stats to hold ", want, " lists (one per norm), got ",
                  stats.size());
    ih.validate_saved(*this, "ih", stats[0], steps, rows, gates, recomputing);
    hh.validate_saved(*this, "hh", stats[1], steps, rows, gates, recomputing);
    if (c != nullptr) c->validate_saved(*this, "c", stats[2], steps, rows, hidden, recomputing);
  }

  int64_t steps = 0, rows = 0, hidden = 0, gates = 0;

 private:
  bool lstm_;
};

Forward lstm_forward(const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0,
                     const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask, const NormArgs& ih,
                     const NormArgs& hh, const NormArgs& c, bool save) {
  Recurrence checks("lstm_forward", true, inputs, "inputs", weight_hh);
  checks.tensor(inputs, Name{"inputs"}, checks.terms());
  checks.tensor(h0, Name{"h0"}, checks.state());
  checks.tensor(c0, Name{"c0"}, checks.state());
  checks.mask(mask);
  checks.norms(ih, hh, &c);
  checks.apart();
  return seqnorm::run_lstm_forward(inputs, h0, c0, weight_hh, mask, ih, hh, c, save);
}

// `sequence`, `weight_ih`: the input projection's x and W_ih where the recurrence was handed them (then `inputs` is
// their product and the gradients of x and W_ih are returned, as far as `want_x` and `want_weight` ask).
Tensors lstm_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& grad_c_n,
                      const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0,
                      const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask, const at::Tensor& hs,
                      const Tensors& saved, const c10::optional<at::Tensor>& raw,
                      const std::vector<Tensors>& stats, const NormArgs& ih, const NormArgs& hh, const NormArgs& c,
                      const c10::optional<at::Tensor>& sequence, const c10::optional<at::Tensor>& weight_ih,
                      bool want_x, bool want_weight) {
  Recurrence checks("lstm_backward", true, grad_hs, "grad_hs", weight_hh);
  checks.tensor(grad_hs, Name{"grad_hs"}, checks.states());
  checks.tensor(grad_h_n, Name{"grad_h_n"}, checks.state());
  checks.tensor(grad_c_n, Name{"grad_c_n"}, checks.state());
  checks.norms(ih, hh, &c);
  if (!ih.identity()) checks.tensor(inputs, Name{"inputs (W_ih x, read by the input norm)"}, checks.terms());
  checks.tensor(h0, Name{"h0"}, checks.state());
  checks.tensor(c0, Name{"c0"}, checks.state());
  checks.mask(mask);
  checks.tensor(hs, Name{"hs"}, checks.states());
  SEQNORM_CHECK(checks, saved.size() == 3, "expected saved to hold 3 tensors (cs, acts, tanh_cs), got ",
                saved.size());
  checks.tensor(saved[0], Name{"saved cs"}, checks.states());
  checks.tensor(saved[1], Name{"saved acts"}, checks.terms());
  checks.tensor(saved[2], Name{"saved tanh_cs"}, checks.states());
  if (hh.identity()) {
    checks.absent(raw, Name{"raw"}, "no recurrent norm");
  } else {
    checks.present(raw, Name{"raw (W_hh h, read by the recurrent norm)"}, checks.terms());
  }
  checks.saved_stats(stats, ih, hh, &c, false);
  checks.projection(sequence, weight_ih, ih);
  return seqnorm::run_lstm_backward(grad_hs, grad_h_n, grad_c_n, inputs, h0, c0, weight_hh, mask, hs, saved, raw, stats,
                                    ih, hh, c, sequence, weight_ih, want_x, want_weight);
}

Forward gru_forward(const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& weight_hh,
                    const c10::optional<at::Tensor>& mask, const NormArgs& ih, const NormArgs& hh, bool save) {
  Recurrence checks("gru_forward", false, inputs, "inputs", weight_hh);
  checks.tensor(inputs, Name{"inputs"}, checks.terms());
  checks.tensor(h0, Name{"h0"}, checks.state());
  checks.mask(mask);
  checks.norms(ih, hh);
  checks.apart();
  return seqnorm::run_gru_forward(inputs, h0, weight_hh, mask, ih, hh, save);
}

Tensors gru_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& inputs,
                     const at::Tensor& h0, const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask,
                     const at::Tensor& hs, const Tensors& saved, const std::vector<Tensors>& stats,
                     const NormArgs& ih, const NormArgs& hh, const c10::optional<at::Tensor>& sequence,
                     const c10::optional<at::Tensor>& weight_ih, bool want_x, bool want_weight) {
  Recurrence checks("gru_backward", false, grad_hs, "grad_hs", weight_hh);
  checks.tensor(grad_hs, Name{"grad_hs"}, checks.states());
  checks.tensor(grad_h_n, Name{"grad_h_n"}, checks.state());
  checks.tensor(inputs, Name{"inputs (W_ih x or the input terms)"}, checks.terms());
  checks.tensor(h0, Name{"h0"}, checks.state());
  checks.mask(mask);
  checks.tensor(hs, Name{"hs"}, checks.states());
  SEQNORM_CHECK(checks, saved.size() == 1, "expected saved to hold 1 tensor (raw, W_hh h), got ", saved.size());
  checks.tensor(saved[0], Name{"saved raw"}, checks.terms());
  checks.norms(ih, hh);
  checks.saved_stats(stats, ih, hh, nullptr, true);
  checks.projection(sequence, weight_ih, ih);
  return seqnorm::run_gru_backward(grad_hs, grad_h_n, inputs, h0, weight_hh, mask, hs, saved, stats, ih, hh, sequence,
                                   weight_ih, want_x, want_weight);
}

std::tuple<at::Tensor, at::Tensor> generation_step(const std::string& cell, const at::Tensor& x, const at::Tensor& h,
                                                   const c10::optional<at::Tensor>& c, const at::Tensor& weight_ih_t,
                                                   const at::Tensor& weight_hh_t, const NormArgs& ih,
                                                   const NormArgs& hh, const NormArgs& c_norm, int64_t step) {
  Checks checks("generation_step", x, Name{"x"});
  const bool lstm = cell == "lstm";
  SEQNORM_CHECK(checks, lstm || cell == "gru", "expected cell 'lstm' or 'gru', got '", cell, "'");
  SEQNORM_CHECK(checks, weight_hh_t.dim() == 2 && weight_hh_t.size(0) >= 1, "expected weight_hh_t (W_hh^T) of shape ",
                lstm ? "(H, 4H)" : "(H, 3H)", " with H >= 1, got ", seqnorm::shape_text(weight_hh_t.sizes()));
  const int64_t hidden = weight_hh_t.size(0), gates = (lstm ? 4 : 3) * hidden;
  SEQNORM_CHECK(checks, x.dim() == 2 || (x.dim() == 3 && x.size(0) == 1),
                "expected x of shape (B, I) or (1, B, I), got ", seqnorm::shape_text(x.sizes()));
  const int64_t rows = x.size(-2), features = x.size(-1);
  checks.tensor(x, Name{"x"}, Shape{x.dim() == 2 ? "(B, I)" : "(1, B, I)", at::DimVector(x.sizes())}, false);
  // The weights may come in either layout (a transposed view or a row-major copy: LayoutChoice); at::mm reads them.
  checks.tensor(weight_ih_t, Name{"weight_ih_t (W_ih^T)"}, Shape{lstm ? "(I, 4H)" : "(I, 3H)", {features, gates}},
                false);
  checks.tensor(weight_hh_t, Name{"weight_hh_t (W_hh^T)"}, Shape{lstm ? "(H, 4H)" : "(H, 3H)", {hidden, gates}},
                false);
  const Shape state{"(1, B, H)", {1, rows, hidden}};
  checks.tensor(h, Name{"h"}, state, false);
  if (lstm) {
    checks.present(c, Name{"c (the LSTM cell state)"}, state, false);
  } else {
    checks.absent(c, Name{"c"}, "a GRU has no cell state");
  }
  SEQNORM_CHECK(checks, step >= 0, "expected step (the time index) >= 0, got ", step);
  ih.validate(checks, "ih", gates, true);
  hh.validate(checks, "hh", gates, true);
  c_norm.validate(checks, "c_norm", hidden, true);
  SEQNORM_CHECK(checks, lstm || c_norm.identity(), "expected c_norm of kind none without a shift (a GRU has no cell ",
                "state), got kind ", c_norm.kind);
  checks.apart();
  return seqnorm::run_generation_step(cell, x, h, c, weight_ih_t, weight_hh_t, ih, hh, c_norm, step);
}

// One norm's step (a cell's step in a user's own loop): x (B, F), mask (B,) bool or None, the norm's time index.
class NormStep : public Checks {
 public:
  NormStep(const char* entry, const at::Tensor& x, const c10::optional<at::Tensor>& mask, const NormArgs& norm,
           int64_t step)
      : Checks(entry, x, Name{"x"}) {
    SEQNORM_CHECK(*this, x.dim() == 2 && x.size(0) >= 1 && x.size(1) >= 1, "expected x of shape (B, F), got ",
                  seqnorm::shape_text(x.sizes()));
    tensor(x, Name{"x"}, Shape{"(B, F)", {x.size(0), x.size(1)}});
    if (given(mask)) tensor(*mask, Name{"mask"}, Shape{"(B,)", {x.size(0)}}, false, at::kBool);
    SEQNORM_CHECK(*this, step >= 0, "expected step (the time index) >= 0, got ", step);
    SEQNORM_CHECK(*this, norm.kind != "none", "expected a norm (kind layer, rms or batch), got kind none");
    norm.validate(*this, "norm", x.size(1), false);
  }
};

// The backward of a norm's step (NormStepBackward below, which the engine calls without the GIL).
Tensors norm_step_backward(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                           const NormArgs& norm, const Tensors& saved, int64_t step) {
  NormStep checks("norm_step_backward", x, mask, norm, step);
  checks.tensor(dy, Name{"dy"}, Shape{"(B, F)", {x.size(0), x.size(1)}});
  norm.validate_saved(checks, "norm", saved, 1, x.size(0), x.size(1), false);
  return seqnorm::run_norm_step_backward(dy, x, mask, norm, saved, step);
}

// ---- a norm's step as one autograd node -------------------------------------------------------------------------
//
// The kernels' norm over one step's real rows (run_norm_step_forward and run_norm_step_backward, recurrence.cpp) as
// one node of the autograd graph, made here in C++: what a Python torch.autograd.Function would do, without the
// ~10 us a Python node costs a step, forward and backward (a BN cell's step in a user's own loop runs two or three
// norms: BatchNormPieces._kernel_step, seqnorm/norms/batch_pieces.py). The node saves x, γ, the shift and the mask as
// torch's own nodes do (a tensor written in place before the backward is refused), and the statistics the forward
// returned. Under create_graph (a second derivative) its backward is the module's own in differentiable torch ops,
// `module._kernel_step_backward(dy, x, mask, weight, shift, saved)`, called with the GIL taken.

class NormStepBackward : public torch::autograd::Node {
 public:
  // `module`: a weak reference to the norm module (None: no second derivative), made with the GIL held.
  NormStepBackward(NormArgs norm, Tensors saved, int64_t step, pybind11::object module)
      : norm_(std::move(norm)), saved_(std::move(saved)), step_(step), module_(module.release().ptr()) {}
  ~NormStepBackward() override {
    if (Py_IsInitialized()) {  // at the interpreter's exit it is left, as torch's Python nodes leave theirs
      pybind11::gil_scoped_acquire gil;
      Py_DECREF(module_);
    }
  }
  std::string name() const override { return "NormStepBackward"; }

  void save(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& shift, const at::Tensor& mask) {
    x_ = torch::autograd::SavedVariable(x, false);
    weight_ = torch::autograd::SavedVariable(weight, false);
    shift_ = torch::autograd::SavedVariable(shift, false);
    mask_ = torch::autograd::SavedVariable(mask, false);
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    weight_.reset_data();
    shift_.reset_data();
    mask_.reset_data();
    saved_.clear();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    // Unpacked first: a second backward through a freed graph, or a saved tensor written in place since, is
    // refused here with torch's own message.
    const at::Tensor x = x_.unpack(), weight = weight_.unpack(), shift = shift_.unpack(), mask = mask_.unpack();
    torch::autograd::variable_list result(3);
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return result;
    const auto optional = [](const at::Tensor& t) {
      return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
    };
    Tensors computed;
    if (torch::autograd::GradMode::is_enabled()) {
      pybind11::gil_scoped_acquire gil;
      const pybind11::object module = module_ == Py_None ? pybind11::none() : pybind11::handle(module_)();
      TORCH_CHECK(!module.is_none(), "seqnorm kernels: NormStepBackward: expected the norm module of this step for ",
                  "its second derivative (create_graph=True), got none: it was deleted, or none was given");
      const pybind11::tuple returned = module.attr("_kernel_step_backward")(
          dy, x, optional(mask), weight, optional(shift), saved_);
      for (const pybind11::handle item : returned) {
        computed.push_back(item.is_none() ? at::Tensor() : item.cast<at::Tensor>());
      }
      TORCH_CHECK(computed.size() == 3, "seqnorm kernels: NormStepBackward: expected _kernel_step_backward to ",
                  "return (dx, weight_grad, shift_grad), got ", computed.size(), " items");
    } else {
      computed = norm_step_backward(dy.contiguous(), x, optional(mask), norm_, saved_, step_);
    }
    for (size_t i = 0; i < 3; ++i) {
      if (task_should_compute_output(i)) result[i] = computed[i];
    }
    return result;
  }

 private:
  NormArgs norm_;
  Tensors saved_;
  int64_t step_;
  PyObject* module_;  // a weakref.ref, or None
  torch::autograd::SavedVariable x_, weight_, shift_, mask_;
};

// A norm's training step as one node (above): y = norm(x) over the real rows, the running statistics updated in
// place; y's grad_fn is a NormStepBackward where x, γ or the shift requires a gradient and grad mode is on. None,
// having done nothing, where x, γ or the shift is a tensor of forward-mode AD or of a torch.func transform: the
// caller then runs its torch-op form, which those support.
c10::optional<at::Tensor> norm_step(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                    const c10::optional<at::Tensor>& shift, const c10::optional<at::Tensor>& mask,
                                    const NormArgs& norm, int64_t step, const pybind11::object& module) {
  // Declined before anything is read: a dual tensor (forward-mode AD), which the node has no derivative for, and a
  // torch.func transform's wrapper (grad, jvp, vmap), whose data these loops cannot index.
  const c10::DispatchKeySet wrapped({c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched});
  for (const c10::optional<at::Tensor>& t : {c10::optional<at::Tensor>(x), weight, shift}) {
    if (Checks::given(t) && (torch::autograd::isFwGradDefined(t) || t->key_set().has_any(wrapped))) {
      return c10::nullopt;
    }
  }
  NormStep checks("norm_step", x, mask, norm, step);
  // γ and the shift are the norm's own, which the kernel reads and whose gradients the node returns to them.
  const auto same = [](const c10::optional<at::Tensor>& given, const c10::optional<at::Tensor>& read) {
    return Checks::given(given) ? Checks::given(read) && given->is_same(*read) : !Checks::given(read);
  };
  SEQNORM_CHECK(checks, same(weight, norm.weight), "expected weight to be norm.weight (the γ the norm reads), got ",
                Checks::given(weight) ? "another tensor" : "None");
  SEQNORM_CHECK(checks, same(shift, norm.shift), "expected shift to be norm.shift (the shift the norm adds), got ",
                Checks::given(shift) ? "another tensor" : "None");
  checks.apart();
  std::tuple<at::Tensor, Tensors> result;
  {
    pybind11::gil_scoped_release released;
    at::NoGradGuard no_grad;
    result = seqnorm::run_norm_step_forward(x, mask, norm, step);
  }
  at::Tensor& y = std::get<0>(result);
  if (torch::autograd::compute_requires_grad(x, weight, shift)) {
    const at::Tensor none;
    // Held weakly: a module that keeps an output of its own step (a hook's record) would otherwise make a cycle
    // through this C++ node, which Python's collector cannot see.
    pybind11::object held = module.is_none() ? pybind11::none() : pybind11::object(pybind11::weakref(module));
    auto node = c10::make_intrusive<NormStepBackward>(norm, std::move(std::get<1>(result)), step, std::move(held));
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight.value_or(none), shift.value_or(none)));
    node->save(x, weight.value_or(none), shift.value_or(none), mask.value_or(none));
    torch::autograd::set_history(y, node);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "seqnorm's fused CPU kernels for normalized LSTM/GRU recurrences (see seqnorm/kernels/__init__.py)";
  pybind11::class_<NormArgs>(m, "NormArgs")
      .def(pybind11::init([](std::string kind, double eps, c10::optional<at::Tensor> weight,
                             c10::optional<at::Tensor> shift, c10::optional<at::Tensor> running_mean,
                             c10::optional<at::Tensor> running_var, c10::optional<at::Tensor> num_batches_tracked,
                             double momentum, bool training, bool renorm, double r_max, double d_max, int64_t warmup,
                             int64_t r_max_steps, int64_t d_max_steps, c10::optional<at::Tensor> folded_scale,
                             c10::optional<at::Tensor> folded_offset) {
             return NormArgs{std::move(kind),         eps,           std::move(weight),
                             std::move(shift),        std::move(running_mean), std::move(running_var),
                             std::move(num_batches_tracked), momentum, training,
                             renorm,                  r_max,         d_max,
                             warmup,                  r_max_steps,   d_max_steps,
                             std::move(folded_scale), std::move(folded_offset)};
           }),
           pybind11::arg("kind"), pybind11::arg("eps"), pybind11::arg("weight"), pybind11::arg("shift"),
           pybind11::arg("running_mean"), pybind11::arg("running_var"), pybind11::arg("num_batches_tracked"),
           pybind11::arg("momentum"), pybind11::arg("training"), pybind11::arg("renorm"), pybind11::arg("r_max"),
           pybind11::arg("d_max"), pybind11::arg("warmup"), pybind11::arg("r_max_steps"),
           pybind11::arg("d_max_steps"), pybind11::arg("folded_scale"), pybind11::arg("folded_offset"))
      .def_readonly("kind", &NormArgs::kind);
  // The entry points run without the GIL (as torch's own ops do): a long recurrence no longer stops every other
  // Python thread. Their arguments are converted before it is released and their results after it is taken back;
  // in between they touch no Python object (NormArgs holds tensors and numbers only; BatchNorm's fold_through runs
  // in Python before the step).
  using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("lstm_forward", &lstm_forward, ReleaseGil());
  m.def("lstm_backward", &lstm_backward, ReleaseGil());
  m.def("gru_forward", &gru_forward, ReleaseGil());
  m.def("gru_backward", &gru_backward, ReleaseGil());
  m.def("generation_step", &generation_step, ReleaseGil());
  m.def("norm_step", &norm_step, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("shift"),
        pybind11::arg("mask"), pybind11::arg("norm"), pybind11::arg("step"), pybind11::arg("module"),
        "A norm's training step as one autograd node (NormStepBackward); the GIL is released around the kernel");
  m.def(
      "saved_empty",
      [](std::vector<int64_t> sizes, at::ScalarType dtype) {
        for (const int64_t size : sizes) {
          TORCH_CHECK_VALUE(size >= 0, "seqnorm kernels: saved_empty: expected sizes >= 0, got ",
                            seqnorm::shape_text(sizes));
        }
        return seqnorm::saved_empty(sizes, at::TensorOptions().dtype(dtype));
      },
      pybind11::arg("sizes"), pybind11::arg("dtype"),
      "An uninitialized CPU tensor for a recurrence's large tensors, on a kept block where one fits (buffers.h)");
  m.def(
      "empty_cache", [] { seqnorm::BufferCache::instance().clear(); },
      "Let go of every block the kernels keep between calls");
  m.def(
      "set_cache_limit", [](int64_t bytes) { seqnorm::BufferCache::instance().set_limit(bytes); },
      pybind11::arg("bytes"), "Keep at most `bytes` of returned blocks (0: none)");
  m.def(
      "cache_info", [] { return seqnorm::BufferCache::instance().info(); },
      "(bytes kept, limit, blocks handed out again, blocks made) of the kernels' kept memory");
  // For the tests of what a fork does to the process-wide locks (the kept memory's, the product trials').
  m.def(
      "_hold_lock",
      [](const std::string& name, double seconds) {
        if (name == "cache") {
          seqnorm::BufferCache::instance().hold_lock(seconds);
        } else if (name == "routes") {
          seqnorm::StepProduct::hold_lock(seconds);
        } else {
          throw std::invalid_argument("_hold_lock: expected cache or routes, got " + name);
        }
      },
      pybind11::arg("name"), pybind11::arg("seconds"), ReleaseGil(),
      "Test only: hold the lock of the kept memory (cache) or the product trials (routes) for `seconds`");
  m.def(
      "_lock_held",
      [](const std::string& name) {
        if (name == "cache") return seqnorm::BufferCache::instance().lock_held();
        if (name == "routes") return seqnorm::StepProduct::lock_held();
        throw std::invalid_argument("_lock_held: expected cache or routes, got " + name);
      },
      pybind11::arg("name"), "Test only: whether some thread holds that lock now");
  m.def("set_product_route", &seqnorm::set_route_setting,
        "Force the per-step matmul's route (where it applies; else the BLAS route) or let it be measured (auto)");
  m.def(
      "product_route",
      [](const at::Tensor& right, int64_t rows) {
        seqnorm::Checks checks("product_route", right, Name{"right"});
        SEQNORM_CHECK(checks, right.dim() == 2 && right.size(0) >= 1 && right.size(1) >= 1,
                      "expected right of shape (K, N) with K, N >= 1, got ", seqnorm::shape_text(right.sizes()));
        checks.tensor(right, Name{"right"}, Shape{"(K, N)", at::DimVector(right.sizes())}, false);
        SEQNORM_CHECK(checks, rows >= 1, "expected rows >= 1, got ", rows);
        seqnorm::StepProduct product(right, rows);
        if (!product.settled()) {  // no recurrence has run this shape yet: its tuning runs on probe products
          const at::Tensor x = at::full({rows, right.size(0)}, 0.5, right.options());  // not drawn: no RNG touched
          at::Tensor out = at::empty({rows, right.size(1)}, right.options());
          while (!product.settled()) product(x, out);
        }
        return std::string(seqnorm::route_name(product.route()));
      },
      ReleaseGil(),
      "The route the per-step product x @ right of `rows` rows takes here (measured now if no recurrence has yet)");
  m.def(
      "product_candidates",
      [](int64_t rows) {
        TORCH_CHECK_VALUE(rows >= 1, "seqnorm kernels: product_candidates: expected rows >= 1, got ", rows);
        std::vector<std::string> names;
        for (const seqnorm::Route route : seqnorm::StepProduct::float_routes(rows)) names.push_back(route_name(route));
        return names;
      },
      "The routes a float32 product of `rows` rows chooses from here (one when forced or deterministic)");
  m.def("chosen_routes", &seqnorm::StepProduct::chosen_routes,
        "The routes measured in this process so far: (rows, K, N, threads, route) each");
  m.def("brgemm_available", &seqnorm::brgemm_works, "Whether oneDNN's float32 brgemm runs here");
  pybind11::class_<seqnorm::Trials>(m, "Trials", "Picks the fastest of a few candidates on the work itself (product.h)")
      .def(pybind11::init<int64_t>(), pybind11::arg("candidates"))
      .def("turn", &seqnorm::Trials::turn, "The candidate to run next")
      .def("record", &seqnorm::Trials::record, pybind11::arg("candidate"), pybind11::arg("seconds"),
           "One run of `candidate` took `seconds`")
      .def_property_readonly("chosen", &seqnorm::Trials::chosen, "The winner once decided, else None")
      .def_property_readonly_static("rounds", [](pybind11::object) { return seqnorm::Trials::kRounds; },
                                    "Rounds of blocks, one block of each candidate per round")
      .def_property_readonly_static("block", [](pybind11::object) { return seqnorm::Trials::kBlock; },
                                    "Consecutive runs of a candidate per round, the first not timed");
}
