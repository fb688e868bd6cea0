#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <dlfcn.h>
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
