// The cells' gates: torch's LSTM and GRU steps (gate order i, f, g, o and r, z, n), written once for the kernels,
// a row at a time (the recurrence runs a row through its norms and gates in one pass). The norms around them are
// norms.h's; the time loop is recurrence.cpp's.
#pragma once

#include "vec.h"

namespace seqnorm {

// ---- LSTM: (i, f, g, o) = pre, c' = σ(f) c + σ(i) tanh(g), h' = σ(o) tanh(N_c(c')) ------------------------------

// One row of a step (pointers at the row):

// acts = (σ(i), σ(f), tanh(g), σ(o)) of the pre-activations (4H), c_new = σ(f) c_prev + σ(i) tanh(g).
template <typename T>
void lstm_gates(const T* pre, T* acts, const T* c_prev, T* c_new, int64_t hidden) {
  vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
    const Vec<T> i = vsigmoid(load(pre + j, n));
    const Vec<T> f = vsigmoid(load(pre + hidden + j, n));
    const Vec<T> g = vtanh(load(pre + 2 * hidden + j, n));
    store(i, acts + j, n);
    store(f, acts + hidden + j, n);
    store(g, acts + 2 * hidden + j, n);
    store(vsigmoid(load(pre + 3 * hidden + j, n)), acts + 3 * hidden + j, n);
    store(at::vec::fmadd(f, load(c_prev + j, n), i * g), c_new + j, n);
  });
}

// tanh_c = tanh(c_out), h = σ(o) tanh_c; a padded row keeps h_prev and c_prev (c is written in place).
template <typename T>
void lstm_output(const T* c_out, const T* acts, T* tanh_c, T* h, T* c, const T* h_prev, const T* c_prev,
                 bool padded, int64_t hidden) {
  vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
    const Vec<T> t = vtanh(load(c_out + j, n));
    store(t, tanh_c + j, n);
    store(load(acts + 3 * hidden + j, n) * t, h + j, n);
  });
  if (padded) {
    std::copy(h_prev, h_prev + hidden, h);
    std::copy(c_prev, c_prev + hidden, c);
  }
}

// One real row's backward (the recurrence handles padded rows, which pass no gradient):

// The gradient reaching N_c's output from dh: dh σ(o) (1 - tanh_c²). `acts` is the row's 4H activations.
template <typename T>
void lstm_output_backward(const T* dh, const T* acts, const T* tanh_c, T* d_c_out, int64_t hidden) {
  const Vec<T> one(T(1));
  vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
    const Vec<T> t = load(tanh_c + j, n);
    store(load(dh + j, n) * load(acts + 3 * hidden + j, n) * (one - t * t), d_c_out + j, n);
  });
}

// Given dL/dc' (dc, carried, plus dc_norm through N_c) and dh: the pre-activations' gradient (4H) and dc for the
// previous step, σ(f) dc', written over dc. `a` is the row's 4H activations.
template <typename T>
void lstm_gates_backward(const T* dh, T* dc, const T* dc_norm, const T* a, const T* tanh_c, const T* c_prev,
                         T* grad_pre, int64_t hidden) {
  const Vec<T> one(T(1));
  vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
    const Vec<T> i = load(a + j, n), f = load(a + hidden + j, n), g = load(a + 2 * hidden + j, n);
    const Vec<T> o = load(a + 3 * hidden + j, n);
    const Vec<T> dct = load(dc + j, n) + load(dc_norm + j, n);
    store(dct * g * i * (one - i), grad_pre + j, n);
    store(dct * load(c_prev + j, n) * f * (one - f), grad_pre + hidden + j, n);
    store(dct * i * (one - g * g), grad_pre + 2 * hidden + j, n);
    store(load(dh + j, n) * load(tanh_c + j, n) * o * (one - o), grad_pre + 3 * hidden + j, n);
    store(dct * f, dc + j, n);
  });
}

// ---- GRU: u = N_hh(W_hh h) + b_hh, (r, z) = σ(a + u), n = tanh(a_n + r u_n), h' = (1 - z) n + z h -------------

// One row of a step (pointers at the row):

// acts = (r, z, n) from the input terms a and the recurrent terms u (3H each); with h, also h' (a padded row keeps
// h_prev). The backward calls it without h to recompute the gates instead of keeping them (GRU activation memory).
template <typename T>
void gru_gates(const T* a, const T* u, T* acts, const T* h_prev, T* h, bool padded, int64_t hidden) {
  if (h != nullptr && padded) std::copy(h_prev, h_prev + hidden, h);
  vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
    const Vec<T> r = vsigmoid(load(a + j, n) + load(u + j, n));
    const Vec<T> z = vsigmoid(load(a + hidden + j, n) + load(u + hidden + j, n));
    const Vec<T> c = vtanh(at::vec::fmadd(r, load(u + 2 * hidden + j, n), load(a + 2 * hidden + j, n)));
    store(r, acts + j, n);
    store(z, acts + hidden + j, n);
    store(c, acts + 2 * hidden + j, n);
    if (h != nullptr && !padded) store(at::vec::fmadd(z, load(h_prev + j, n) - c, c), h + j, n);
  });
}

// One real row's backward from dh: the input terms' gradient (r, z, n parts), the recurrent terms' gradient du (its
// n part gated by r) and the carry dh z to the previous state, written over dh. u are the recurrent terms (3H), of
// which the candidate's part u_n is read.
template <typename T>
void gru_gates_backward(T* dh, const T* acts, const T* u, const T* h_prev, T* grad_a, T* grad_u, int64_t hidden) {
  const Vec<T> one(T(1));
  vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
    const Vec<T> r = load(acts + j, n), z = load(acts + hidden + j, n);
    const Vec<T> c = load(acts + 2 * hidden + j, n);
    const Vec<T> d = load(dh + j, n);
    const Vec<T> dn = d * (one - z) * (one - c * c);
    const Vec<T> dz = d * (load(h_prev + j, n) - c) * z * (one - z);
    const Vec<T> dr = dn * load(u + 2 * hidden + j, n) * r * (one - r);
    store(dr, grad_a + j, n);
    store(dz, grad_a + hidden + j, n);
    store(dn, grad_a + 2 * hidden + j, n);
    store(dr, grad_u + j, n);
    store(dz, grad_u + hidden + j, n);
    store(dn * r, grad_u + 2 * hidden + j, n);
    store(d * z, dh + j, n);
  });
}

}  // namespace seqnorm
