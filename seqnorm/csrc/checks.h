// The bindings' checks of their arguments, made before anything reads or writes their memory (as torch's ATen
// kernels check every shape, dtype and device at the boundary): a call the kernels cannot run raises ValueError
// (TypeError for a dtype) that names the entry point, the argument, what was expected and what came, instead of
// reading past a buffer. The bindings (bindings.cpp) state each argument's shape here; NormArgs::validate (norms.h)
// checks a norm's tensors against the features it normalizes.
//
// A passing check builds no message (SEQNORM_CHECK's pieces are evaluated only on failure): a generation step takes
// about 20 us, and its checks must not show in it.
#pragma once

#include <torch/extension.h>

#include <ATen/MemoryOverlap.h>

#include <c10/util/SmallVector.h>

#include <ostream>
#include <sstream>
#include <string>
#include <utility>

// Raises ValueError "seqnorm kernels: <entry>: " followed by the message's pieces where `cond` fails.
#define SEQNORM_CHECK(checks, cond, ...) \
  if (C10_UNLIKELY(!(cond))) (checks).fail(__VA_ARGS__)

namespace seqnorm {

// "(5, 4, 128)"
inline std::string shape_text(at::IntArrayRef sizes) {
  std::ostringstream text;
  text << "(";
  for (size_t i = 0; i < sizes.size(); ++i) text << (i ? ", " : "") << sizes[i];
  text << (sizes.size() == 1 ? ",)" : ")");
  return text.str();
}

// An argument's name: "h0", or a norm's field "ih.weight".
struct Name {
  const char* owner;
  const char* field = nullptr;
};

inline std::ostream& operator<<(std::ostream& out, const Name& name) {
  out << name.owner;
  if (name.field != nullptr) out << "." << name.field;
  return out;
}

inline bool operator==(const Name& a, const Name& b) {
  return std::string(a.owner) == b.owner && (a.field == nullptr) == (b.field == nullptr) &&
         (a.field == nullptr || std::string(a.field) == b.field);
}

// A tensor's expected shape: its sizes and how the docs write them ("(T, B, 4H)").
struct Shape {
  const char* dims;
  at::DimVector sizes;
};

class Checks {
 public:
  // `entry`: the binding's name. The call's dtype is `first`'s (float32 or float64), which every floating tensor of
  // the call shares.
  Checks(const char* entry, const at::Tensor& first, const Name& name) : entry_(entry) {
    SEQNORM_CHECK(*this, first.defined(), "expected ", name, " to be a tensor, got None");
    TORCH_CHECK_TYPE(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble, prefix(), "expected ",
                     name, " of dtype float32 or float64, got ", first.scalar_type());
    dtype_ = first.scalar_type();
  }

  at::ScalarType dtype() const { return dtype_; }

  // Raises ValueError with the message's pieces after the entry point's name.
  template <typename... Args>
  [[noreturn]] void fail(const Args&... message) const {
    TORCH_CHECK_VALUE(false, prefix(), message...);
    std::abort();  // not reached: the check above throws
  }

  // `t` is a CPU tensor of `shape`, of the call's dtype (or `dtype`), contiguous where `dense` (the kernels index
  // it as dense rows); kept for the overlap check (apart).
  void tensor(const at::Tensor& t, const Name& name, const Shape& shape, bool dense = true,
              c10::optional<at::ScalarType> dtype = c10::nullopt) {
    SEQNORM_CHECK(*this, t.defined(), "expected ", name, " of shape ", shape.dims, " = ", shape_text(shape.sizes),
                  ", got None");
    const at::ScalarType want = dtype.value_or(dtype_);
    TORCH_CHECK_TYPE(t.scalar_type() == want, prefix(), "expected ", name, " of dtype ", want, " (",
                     dtype.has_value() ? "its fixed dtype" : "the call's dtype", "), got ", t.scalar_type());
    SEQNORM_CHECK(*this, t.device().is_cpu(), "expected ", name, " on the CPU, got ", t.device());
    SEQNORM_CHECK(*this, t.sizes() == at::IntArrayRef(shape.sizes), "expected ", name, " of shape ", shape.dims,
                  " = ", shape_text(shape.sizes), ", got ", shape_text(t.sizes()));
    SEQNORM_CHECK(*this, !dense || t.is_contiguous(), "expected ", name,
                  " to be contiguous (indexed as dense rows), got strides ", shape_text(t.strides()));
    read_.emplace_back(t, name);
  }

  // An optional tensor the call needs.
  const at::Tensor& present(const c10::optional<at::Tensor>& t, const Name& name, const Shape& shape,
                            bool dense = true, c10::optional<at::ScalarType> dtype = c10::nullopt) {
    SEQNORM_CHECK(*this, given(t), "expected ", name, " of shape ", shape.dims, " = ", shape_text(shape.sizes),
                  ", got None");
    tensor(*t, name, shape, dense, dtype);
    return *t;
  }

  // An optional tensor the call must not be given (`why`: the reason).
  void absent(const c10::optional<at::Tensor>& t, const Name& name, const char* why) const {
    SEQNORM_CHECK(*this, !given(t), "expected ", name, " to be None (", why, "), got a tensor of shape ",
                  shape_text(t->sizes()));
  }

  // `t`, checked already, is updated in place by the call.
  void written(const at::Tensor& t, const Name& name) { written_.emplace_back(t, name); }

  // Last: the tensors the call writes in place share no memory with one another or with any other tensor checked.
  void apart() const {
    for (const auto& [target, target_name] : written_) {
      SEQNORM_CHECK(*this, at::has_internal_overlap(target) != at::MemOverlap::Yes, "expected ", target_name,
                    " (updated in place) without internal overlap, got strides ", shape_text(target.strides()));
      for (const auto& [other, other_name] : read_) {
        // Another storage cannot overlap (get_overlap_status says "too hard" for any strided pair).
        if (other_name == target_name || other.numel() == 0 || !other.storage().is_alias_of(target.storage())) {
          continue;
        }
        SEQNORM_CHECK(*this, at::get_overlap_status(target, other) == at::MemOverlapStatus::No, "expected ",
                      target_name, " (updated in place) to share no memory with ", other_name,
                      ", got overlapping tensors");
      }
    }
  }

  static bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

  std::string prefix() const { return std::string("seqnorm kernels: ") + entry_ + ": "; }

 private:
  const char* entry_;
  at::ScalarType dtype_ = at::kFloat;
  c10::SmallVector<std::pair<at::Tensor, Name>, 24> read_;  // every tensor checked
  c10::SmallVector<std::pair<at::Tensor, Name>, 6> written_;  // those the call updates in place
};

}  // namespace seqnorm
