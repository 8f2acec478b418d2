// What every AMX path of the CPU kernels shares: whether tiles may run here, the tile
// configuration's memory layout, and the compiler barrier tile loads need.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDQ_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace pagedq_amx {

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out AMX's 8 KiB register state only to processes that ask (once per process;
// asking again is harmless, and oneDNN asks too). False if the kernel refuses.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// PAGEDQ_CPU_AMX=0 turns every AMX path off (read at each call, so that a bench can time both
// paths in one process).
inline bool amx_enabled() {
  const char* env = std::getenv("PAGEDQ_CPU_AMX");
  if (env != nullptr && env[0] == '0' && env[1] == '\0') return false;
  return amx_permitted();
}

}  // namespace pagedq_amx

// GCC's tile loads and ldtilecfg tell the compiler of no memory they read (nor tile stores of
// any they write): this barrier keeps the stores they depend on before them.
#define PQ_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

#endif
