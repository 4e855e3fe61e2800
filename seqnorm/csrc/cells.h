// The cells' gates: torch's LSTM and GRU steps (gate order i, f, g, o and r, z, n), written once for the kernels,
// the LSTM's a row at a time (the recurrence runs a row through its norms and gates in one pass), the GRU's a block
// of rows. The norms around them are norms.h's; the time loop is recurrence.cpp's.
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

// acts = (r, z, n) from the input terms a and the recurrent terms u (rows x 3H); with h, also h' (padded rows keep
// h_prev). The backward calls it without h to recompute the gates instead of keeping them (GRU activation memory).
template <typename T>
void gru_gates(const T* a, const T* u, T* acts, const T* h_prev, T* h, const bool* mask, int64_t rows,
               int64_t hidden) {
  over_rows(rows, 3 * hidden, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t gates = b * 3 * hidden, row = b * hidden;
      const bool padded = mask != nullptr && !mask[b];
      if (h != nullptr && padded) std::copy(h_prev + row, h_prev + row + hidden, h + row);
      vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
        const Vec<T> r = vsigmoid(load(a + gates + j, n) + load(u + gates + j, n));
        const Vec<T> z = vsigmoid(load(a + gates + hidden + j, n) + load(u + gates + hidden + j, n));
        const Vec<T> c = vtanh(at::vec::fmadd(r, load(u + gates + 2 * hidden + j, n), load(a + gates + 2 * hidden + j, n)));
        store(r, acts + gates + j, n);
        store(z, acts + gates + hidden + j, n);
        store(c, acts + gates + 2 * hidden + j, n);
        if (h != nullptr && !padded) store(at::vec::fmadd(z, load(h_prev + row + j, n) - c, c), h + row + j, n);
      });
    }
  });
}

// From dh: the input terms' gradient (r, z, n parts; zero on padded rows), the recurrent terms' gradient du (its
// n part gated by r) and the carry dh z to the previous state (dh itself on padded rows), written over dh. u are
// the recurrent terms (rows x 3H), of which the candidate's part u_n is read.
template <typename T>
void gru_gates_backward(T* dh, const T* acts, const T* u, const T* h_prev, T* grad_a, T* grad_u,
                        const bool* mask, int64_t rows, int64_t hidden) {
  const Vec<T> one(T(1));
  over_rows(rows, 3 * hidden, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t gates = b * 3 * hidden, row = b * hidden;
      if (mask != nullptr && !mask[b]) {
        std::fill(grad_a + gates, grad_a + gates + 3 * hidden, T(0));
        std::fill(grad_u + gates, grad_u + gates + 3 * hidden, T(0));
        continue;
      }
      vec_loop<T>(hidden, [&](int64_t j, int64_t n) {
        const Vec<T> r = load(acts + gates + j, n), z = load(acts + gates + hidden + j, n);
        const Vec<T> c = load(acts + gates + 2 * hidden + j, n);
        const Vec<T> d = load(dh + row + j, n);
        const Vec<T> dn = d * (one - z) * (one - c * c);
        const Vec<T> dz = d * (load(h_prev + row + j, n) - c) * z * (one - z);
        const Vec<T> dr = dn * load(u + gates + 2 * hidden + j, n) * r * (one - r);
        store(dr, grad_a + gates + j, n);
        store(dz, grad_a + gates + hidden + j, n);
        store(dn, grad_a + gates + 2 * hidden + j, n);
        store(dr, grad_u + gates + j, n);
        store(dz, grad_u + gates + hidden + j, n);
        store(dn * r, grad_u + gates + 2 * hidden + j, n);
        store(d * z, dh + row + j, n);
      });
    }
  });
}

}  // namespace seqnorm
