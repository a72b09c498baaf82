// A replayed CPU graph's kernel calls, made from C one after another (cpu_graph.py).
//
// Calling a kernel through ctypes costs 1-2 us even with its arguments converted once (110
// calls a decode step of the 97 M model: ~0.15 ms, AMD Zen 3). Here a run of calls is one
// ctypes call: each kernel is called through a function pointer of its own C type, with its
// arguments read from 8-byte slots (pointers and integers as int64, a float's bits in the low
// four bytes). The compiler makes each call, so the platform's calling convention holds.
//
// The C types are the signatures below, each named by a code: the return type, then the
// arguments ('v' void, 'i' int, 'l' int64, 'p' pointer, 'f' float). cpu_graph.py derives a
// kernel's code from its ctypes restype and argtypes; a kernel whose code is not here is called
// from Python, as before.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace {

template <class T> T slot_value(int64_t s);
template <> void* slot_value<void*>(int64_t s) { return reinterpret_cast<void*>(s); }
template <> int64_t slot_value<int64_t>(int64_t s) { return s; }
template <> int slot_value<int>(int64_t s) { return static_cast<int>(s); }
template <> float slot_value<float>(int64_t s) {
  const uint32_t bits = static_cast<uint32_t>(s);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <class T> constexpr char type_code() {
  if constexpr (std::is_void_v<T>) return 'v';
  else if constexpr (std::is_same_v<T, int>) return 'i';
  else if constexpr (std::is_same_v<T, int64_t>) return 'l';
  else if constexpr (std::is_same_v<T, void*>) return 'p';
  else {
    static_assert(std::is_same_v<T, float>, "a slot holds void*, int64_t, int or float");
    return 'f';
  }
}

using Caller = int (*)(void* fn, const int64_t* slots);

template <class R, class... A> struct Signature {
  static constexpr char code[] = {type_code<R>(), type_code<A>()..., '\0'};

  template <size_t... I>
  static int call_with(void* fn, const int64_t* s, std::index_sequence<I...>) {
    auto f = reinterpret_cast<R (*)(A...)>(fn);
    if constexpr (std::is_void_v<R>) {
      f(slot_value<A>(s[I])...);
      return 0;
    } else {
      return static_cast<int>(f(slot_value<A>(s[I])...));
    }
  }
  static int call(void* fn, const int64_t* s) {
    return call_with(fn, s, std::index_sequence_for<A...>{});
  }
};

struct Entry {
  const char* code;
  Caller call;
};

#define LLS_SIGNATURE(...) Entry{Signature<__VA_ARGS__>::code, Signature<__VA_ARGS__>::call}
using P = void*;
using L = int64_t;

// The kernels' C types (layer kernels: cpu_layer_ops.cpp; attention: cpu_paged_attention.cpp).
const Entry kSignatures[] = {
    // lls_linear_f32, lls_linear_bf16 (and its AMX and dot variants)
    LLS_SIGNATURE(int, P, L, P, P, L, L, L, int, P, P, P),
    // lls_linear_blas_f32
    LLS_SIGNATURE(int, P, L, P, L, P, P, L, L, L, int, P, P, P),
    // lls_reshape_and_cache(_bf16)
    LLS_SIGNATURE(int, P, L, P, L, P, P, P, L, L, L, L),
    // lls_paged_attention(_bf16), ALiBi slopes last
    LLS_SIGNATURE(int, P, L, P, P, P, L, P, P, L, L, L, L, L, L, L, float, P, L, P),
    // lls_attention_fused(_bf16), ALiBi slopes last
    LLS_SIGNATURE(int, P, L, P, L, P, L, P, P, P, L, P, L, P, P, L, L, L, L, L, L, L, float, P,
                  L, P),
    LLS_SIGNATURE(void, P, P, P, L, L, float),             // rms_norm_f32
    LLS_SIGNATURE(void, P, P, P, P, L, L, float),          // add_rms_norm_f32, layer_norm_f32
    LLS_SIGNATURE(void, P, P, P, P, P, L, L, float),       // add_layer_norm_f32
    LLS_SIGNATURE(void, P, P, P, L, L),                    // add_rows_f32
    LLS_SIGNATURE(void, P, P, L, L, int),                  // gelu_f32
    LLS_SIGNATURE(void, P, P, P, P, L, L, L, L, L, L),     // rotary_embedding_f32
    LLS_SIGNATURE(void, P, P, L, L),                       // silu_and_mul_f32
};
#undef LLS_SIGNATURE
constexpr int kNumSignatures = sizeof kSignatures / sizeof kSignatures[0];

}  // namespace

extern "C" {

int lls_replay_abi_version() { return 1; }

// The id of a signature code (see above), or -1 if there is none.
int lls_replay_signature(const char* code) {
  for (int i = 0; i < kNumSignatures; ++i)
    if (std::strcmp(kSignatures[i].code, code) == 0) return i;
  return -1;
}

// Call n kernels in order: kernel i is fns[i], of signature sigs[i] (an id from
// lls_replay_signature), with its arguments in slots[offsets[i]...]. Returns 0, or i + 1 for
// the first kernel that returned non-zero or has no such signature (it and the later ones are
// then not called).
int64_t lls_replay(const uint64_t* fns, const int32_t* sigs, const int64_t* offsets,
                   const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (sigs[i] < 0 || sigs[i] >= kNumSignatures) return i + 1;
    void* fn = reinterpret_cast<void*>(fns[i]);
    if (kSignatures[sigs[i]].call(fn, slots + offsets[i]) != 0) return i + 1;
  }
  return 0;
}

}  // extern "C"
