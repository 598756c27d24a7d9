// Unpacking of cuLaunchKernel's kernelParams by a kernel's real C signature: the generated
// table (../gen) instantiates Sig for decltype(&kernel), so an argument is read with the type
// and size kernels.cu declares, never with a hand-written copy of it.
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace cudaemu {

template <typename F> struct Sig;

template <typename... A> struct Sig<void (*)(A...)> {
    static constexpr int arity = sizeof...(A);
    template <size_t I> using Arg = std::tuple_element_t<I, std::tuple<A...>>;

    template <void (*f)(A...)> static void run(void **p) { call<f>(p, std::index_sequence_for<A...>{}); }

  private:
    template <void (*f)(A...), size_t... I> static void call(void **p, std::index_sequence<I...>) {
        f(*reinterpret_cast<A *>(p[I])...);
    }
};

template <typename T> constexpr size_t elemSize() {
    if constexpr (std::is_pointer_v<T> && !std::is_void_v<std::remove_cv_t<std::remove_pointer_t<T>>>) {
        return sizeof(std::remove_pointer_t<T>);
    } else {
        return 0;
    }
}

} // namespace cudaemu

// The ParamInfo of parameter I of kernel F.
#define CUDAEMU_PARAM(F, I, NAME, TYPE)                                                                    \
    {                                                                                                      \
        NAME, TYPE, std::is_pointer_v<::cudaemu::Sig<decltype(&F)>::Arg<I>>,                               \
            sizeof(::cudaemu::Sig<decltype(&F)>::Arg<I>), ::cudaemu::elemSize<::cudaemu::Sig<decltype(&F)>::Arg<I>>() \
    }
