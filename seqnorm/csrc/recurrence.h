// The time loops' entry points (recurrence.cpp), one per loop, each dispatching on the dtype (float32, float64).
// They assume checked arguments: the bindings (bindings.cpp) check every argument first.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "norms.h"

namespace seqnorm {

using Tensors = std::vector<at::Tensor>;
// hs, h_n (and c_n); what the backward needs; each norm's saved statistics; each norm's fallback steps
using Forward = std::tuple<Tensors, Tensors, std::vector<Tensors>, std::vector<int64_t>>;

Forward run_lstm_forward(const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0,
                         const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask, const NormArgs& ih,
                         const NormArgs& hh, const NormArgs& c, bool save);

Tensors run_lstm_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& grad_c_n,
                          const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& c0,
                          const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask, const at::Tensor& hs,
                          const Tensors& saved, const c10::optional<at::Tensor>& raw,
                          const std::vector<Tensors>& stats, const NormArgs& ih, const NormArgs& hh,
                          const NormArgs& c, const c10::optional<at::Tensor>& sequence,
                          const c10::optional<at::Tensor>& weight_ih, bool want_x, bool want_weight);

Forward run_gru_forward(const at::Tensor& inputs, const at::Tensor& h0, const at::Tensor& weight_hh,
                        const c10::optional<at::Tensor>& mask, const NormArgs& ih, const NormArgs& hh, bool save);

Tensors run_gru_backward(const at::Tensor& grad_hs, const at::Tensor& grad_h_n, const at::Tensor& inputs,
                         const at::Tensor& h0, const at::Tensor& weight_hh, const c10::optional<at::Tensor>& mask,
                         const at::Tensor& hs, const Tensors& saved, const std::vector<Tensors>& stats,
                         const NormArgs& ih, const NormArgs& hh, const c10::optional<at::Tensor>& sequence,
                         const c10::optional<at::Tensor>& weight_ih, bool want_x, bool want_weight);

std::tuple<at::Tensor, at::Tensor> run_generation_step(const std::string& cell, const at::Tensor& x,
                                                       const at::Tensor& h, const c10::optional<at::Tensor>& c,
                                                       const at::Tensor& weight_ih_t, const at::Tensor& weight_hh_t,
                                                       const NormArgs& ih, const NormArgs& hh,
                                                       const NormArgs& c_norm, int64_t step);

// One norm's step over x (B, F) (a cell's step in a user's own loop): y and the norm's saved statistics; and its
// backward over the real rows of `mask` (B,) bool (padded rows get no gradient): dx, dγ, dshift.
std::tuple<at::Tensor, Tensors> run_norm_step_forward(const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                                                      const NormArgs& norm, int64_t step);
Tensors run_norm_step_backward(const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                               const NormArgs& norm, const Tensors& saved, int64_t step);

}  // namespace seqnorm
