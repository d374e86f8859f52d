// Generalised advantage estimation over PACKED sequences, on CPU.
//
// Packed layout: the response tokens of S sequences are concatenated into one array of N
// tokens; sequence s occupies [cu_seqlens[s], cu_seqlens[s + 1]). Each sequence is an
// episode on its own: the value after its last token is 0 and nothing crosses a boundary.
//
// Python twin: rlflow.algos.packed_gae.gae_packed_torch (the tests compare the two).
// The recursion runs in the input precision, in the same operation order as the torch
// version, so float32 results agree with it to the last few ulps.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

void check_layout(const py::buffer_info& rewards, const py::buffer_info& values, const py::buffer_info& cu) {
  if (rewards.ndim != 1 || values.ndim != 1 || cu.ndim != 1) {
    throw std::invalid_argument("gae_packed: rewards, values and cu_seqlens must be 1-D");
  }
  if (rewards.shape[0] != values.shape[0]) {
    throw std::invalid_argument("gae_packed: rewards has " + std::to_string(rewards.shape[0]) +
                                " tokens but values has " + std::to_string(values.shape[0]));
  }
  if (cu.shape[0] < 1) {
    throw std::invalid_argument("gae_packed: cu_seqlens must hold at least the leading 0");
  }
  const auto* offsets = static_cast<const int64_t*>(cu.ptr);
  const int64_t num_seqs = cu.shape[0] - 1;
  if (offsets[0] != 0) {
    throw std::invalid_argument("gae_packed: cu_seqlens[0] must be 0, got " + std::to_string(offsets[0]));
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (offsets[s + 1] < offsets[s]) {
      throw std::invalid_argument("gae_packed: cu_seqlens decreases at position " + std::to_string(s + 1));
    }
  }
  if (offsets[num_seqs] != rewards.shape[0]) {
    throw std::invalid_argument("gae_packed: cu_seqlens[-1]=" + std::to_string(offsets[num_seqs]) +
                                " but there are " + std::to_string(rewards.shape[0]) + " tokens");
  }
}

// Returns (advantages, returns), each of shape (N,).
template <typename T>
py::tuple gae_packed(py::array_t<T, py::array::c_style> rewards, py::array_t<T, py::array::c_style> values,
                     py::array_t<int64_t, py::array::c_style> cu_seqlens, double gamma, double lam) {
  const py::buffer_info r_info = rewards.request();
  const py::buffer_info v_info = values.request();
  const py::buffer_info cu_info = cu_seqlens.request();
  check_layout(r_info, v_info, cu_info);

  const int64_t num_tokens = r_info.shape[0];
  const int64_t num_seqs = cu_info.shape[0] - 1;
  py::array_t<T> advantages(num_tokens);
  py::array_t<T> returns(num_tokens);
  const T* r = static_cast<const T*>(r_info.ptr);
  const T* v = static_cast<const T*>(v_info.ptr);
  const int64_t* offsets = static_cast<const int64_t*>(cu_info.ptr);
  T* adv = static_cast<T*>(advantages.request().ptr);
  T* ret = static_cast<T*>(returns.request().ptr);
  const T g = static_cast<T>(gamma);
  const T gl = static_cast<T>(gamma * lam);  // torch evaluates gamma * lam in double, then casts

  {
    py::gil_scoped_release release;
    for (int64_t s = 0; s < num_seqs; ++s) {
      T next_value = 0;  // V after the sequence's last token
      T last_adv = 0;
      for (int64_t t = offsets[s + 1] - 1; t >= offsets[s]; --t) {
        const T delta = r[t] + g * next_value - v[t];
        last_adv = delta + gl * last_adv;
        next_value = v[t];
        adv[t] = last_adv;
        ret[t] = last_adv + v[t];
      }
    }
  }
  return py::make_tuple(advantages, returns);
}

}  // namespace

PYBIND11_MODULE(_C_gae, m) {
  m.doc() = "Packed-sequence GAE on CPU (twin: rlflow.algos.packed_gae.gae_packed_torch)";
  m.def("gae_packed_f32", &gae_packed<float>, py::arg("rewards"), py::arg("values"), py::arg("cu_seqlens"),
        py::arg("gamma"), py::arg("lam"), "GAE over packed float32 sequences; returns (advantages, returns).");
  m.def("gae_packed_f64", &gae_packed<double>, py::arg("rewards"), py::arg("values"), py::arg("cu_seqlens"),
        py::arg("gamma"), py::arg("lam"), "GAE over packed float64 sequences; returns (advantages, returns).");
}
