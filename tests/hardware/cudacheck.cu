#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <string>
#include <thread>
__global__ void spin(float *a, int n, int iters) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float x = a[i]; for (int k = 0; k < iters; k++) x = x * 1.0000001f + 0.5f; a[i] = x; }
}
int main(int argc, char **argv) {
  // The driver as the runtime will find it: which file, and what cuInit says.
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    printf("libcuda: %s\n", dlerror());
  } else {
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(lib, "cuInit");
    int (*ver)(int *) = (int (*)(int *))dlsym(lib, "cuDriverGetVersion");
    int v = 0;
    int rv = ver ? ver(&v) : -1;
    printf("libcuda: cuInit=%d cuDriverGetVersion=%d (%d)\n", init ? init(0) : -1, v, rv);
  }
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  printf("cuda_count=%d err=%s\n", n, cudaGetErrorString(e));
  if (e != cudaSuccess || n == 0) return 2;
  for (int d = 0; d < n; d++) {
    cudaDeviceProp p; cudaGetDeviceProperties(&p, d);
    printf("device %d: %s uuid=GPU-", d, p.name);
    for (int k = 0; k < 16; k++) { printf("%02x", (unsigned char)p.uuid.bytes[k]); if (k == 3 || k == 5 || k == 7 || k == 9) printf("-"); }
    printf(" mem=%zu MiB\n", (size_t)(p.totalGlobalMem >> 20));
  }
  // `alloc MIB HOLD`: allocate up to MIB in 64 MiB pieces (as far as the
  // device, MPS or the driver's cap allows), hold it HOLD seconds.
  if (argc > 3 && std::string(argv[1]) == "alloc") {
    long want = atol(argv[2]), got = 0;
    cudaError_t err = cudaSuccess;
    while (got < want) {
      void *p = nullptr;
      err = cudaMalloc(&p, 64 << 20);
      if (err != cudaSuccess) break;
      got += 64;
    }
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    printf("alloc want=%ld got=%ld err=%s free=%zu total=%zu MiB\n", want, got, cudaGetErrorString(err),
           free_b >> 20, total_b >> 20);
    fflush(stdout);
    std::this_thread::sleep_for(std::chrono::seconds(atoi(argv[3])));
    return err == cudaSuccess ? 0 : 3;
  }
  double secs = argc > 1 ? atof(argv[1]) : 0;
  if (secs > 0) {
    size_t N = 1 << 26; float *a; cudaMalloc(&a, N * 4); cudaMemset(a, 0, N * 4);
    auto t0 = std::chrono::steady_clock::now(); int launches = 0;
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < secs) {
      spin<<<(N + 255) / 256, 256>>>(a, (int)N, 2000); cudaDeviceSynchronize(); launches++;
    }
    printf("burn done launches=%d err=%s\n", launches, cudaGetErrorString(cudaGetLastError()));
  }
  return 0;
}
