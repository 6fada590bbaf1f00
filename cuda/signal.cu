/*
 * signal.cu: the completion signal of a worker's stream (ARCHITECTURE.md §5, serve_kernels.h).
 *
 * The counter lives in pinned, mapped, not write-combined host memory; the poller thread only
 * does acquire loads of it. No stream callbacks or host functions are ever used for completion.
 */
#include "serve_device.cuh"

/* libcu++ (<cuda/atomic>, from the CUDA toolkit or the nvidia-cuda-cccl wheel) when the compiler
 * can see it; otherwise (NVRTC without the CCCL headers) the PTX instruction it compiles to for a
 * system-scope release fetch_add whose result is unused: red.release.sys.add.u64 on a generic
 * address (sm_70+). */
#if defined(__has_include)
#if __has_include(<cuda/atomic>)
#include <cuda/atomic>
#define SERVE_HAVE_CUDA_ATOMIC 1
#endif
#endif

SERVE_KERNEL serve_signal(const serve_signal_params p) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    unsigned long long *counter = serve_ptr<unsigned long long>(p.counter);
#if defined(SERVE_HOST_EMULATION)
    /* The kernel run on the CPU by the tests (cuda/host/): the same release increment. */
    __atomic_fetch_add(counter, 1ull, __ATOMIC_RELEASE);
#elif defined(SERVE_HAVE_CUDA_ATOMIC)
    cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> count(*counter);
    count.fetch_add(1ull, cuda::std::memory_order_release);
#else
    asm volatile("red.release.sys.add.u64 [%0], %1;" : : "l"(counter), "l"(1ull) : "memory");
#endif
}
