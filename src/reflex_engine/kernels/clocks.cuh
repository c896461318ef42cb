// Where a block's time goes, in a timing build only (build_kernels.py with REFLEX_CUDA_CLOCKS=1 defines
// REFLEX_CLOCKS; tools/probe_clocks.py reads the records back): thread 0 of every block of every kernel that follows
// the one before (common.cuh follow_previous_kernel) writes a record of its launch (%gridid), its block and SM and
// the SM clock at its marks: the kernel's start and end where the kernel holds a BlockClock, the wait for the kernel
// before, and a step's bytes in and products done where the kernel marks its steps. The wait's two marks carry the
// global timer too, which places the records of different SMs on one time line. In every other build the marks
// are empty functions, and the kernels are the same code.
#pragma once
#include <stdint.h>

enum ClockMark {
    MARK_START,  // the block began (a kernel holding a BlockClock)
    MARK_WAIT,  // it began waiting for the kernel before
    MARK_FOLLOWED,  // that kernel had ended
    MARK_END,  // thread 0 was done (a kernel holding a BlockClock)
    MARK_STEP,  // step k: MARK_STEP + 2k its bytes in, MARK_STEP + 2k + 1 its products done
};
constexpr int CLOCK_STEPS = 10;
constexpr int CLOCK_MARKS = MARK_STEP + 2 * CLOCK_STEPS;

#ifdef REFLEX_CLOCKS
// tools/probe_clocks.py reads this layout (its RECORD dtype): 136 bytes. A block holding a BlockClock writes two
// records, its wait's and its own marks' (the probe joins them): the wait's keeps its record in a register, a
// BlockClock's in 8 bytes of shared memory, which a kernel of 48 KB of static shared memory (gemm_f16_128) has not.
struct BlockClocks {
    uint64_t grid;  // %gridid: which launch
    uint32_t block, sm, blocks, pad;  // the block's linear index, its SM, the launch's blocks
    uint64_t wait_ns, followed_ns;  // %globaltimer at MARK_WAIT and MARK_FOLLOWED
    uint32_t marks[CLOCK_MARKS];  // %clock at each mark, | 1 (0: not marked); the probe zeroes them before a run
};
static_assert(sizeof(BlockClocks) == 136, "tools/probe_clocks.py's RECORD");
constexpr unsigned CLOCK_RECORDS = 1u << 18;  // a decode step's blocks, twice for some, and room to spare
__device__ BlockClocks reflex_clocks[CLOCK_RECORDS];
__device__ unsigned reflex_clocks_used;  // records taken; the probe zeroes it before a run

// A new record of the calling block (thread 0), null past CLOCK_RECORDS.
__device__ __forceinline__ BlockClocks* new_clock_record() {
    const unsigned i = atomicAdd(&reflex_clocks_used, 1u);
    if (i >= CLOCK_RECORDS) return nullptr;
    BlockClocks* r = &reflex_clocks[i];
    uint64_t grid;
    uint32_t sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r->grid = grid, r->block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x, r->sm = sm;
    r->blocks = gridDim.x * gridDim.y * gridDim.z;
    return r;
}

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}

__device__ __forceinline__ void stamp(BlockClocks* r, int mark) {
    if (r) r->marks[mark] = (uint32_t)clock() | 1u;
}

// The wait for the kernel before (common.cuh follow_previous_kernel): its record, begun; thread 0 only.
__device__ __forceinline__ BlockClocks* clock_wait_begins() {
    if (threadIdx.x != 0) return nullptr;
    BlockClocks* r = new_clock_record();
    if (r) r->wait_ns = global_ns();
    stamp(r, MARK_WAIT);
    return r;
}
__device__ __forceinline__ void clock_wait_ends(BlockClocks* r) {
    stamp(r, MARK_FOLLOWED);
    if (r) r->followed_ns = global_ns();
}

// The record of the block's BlockClock, which thread 0 alone reads and writes.
__device__ __forceinline__ BlockClocks*& block_clock_record() {
    __shared__ BlockClocks* record;
    return record;
}

// A kernel's start and end, held for its body: `const BlockClock clocked;` as its first statement.
struct BlockClock {
    __device__ __forceinline__ BlockClock() {
        if (threadIdx.x != 0) return;
        block_clock_record() = new_clock_record();
        stamp(block_clock_record(), MARK_START);
    }
    __device__ __forceinline__ ~BlockClock() {
        if (threadIdx.x == 0) stamp(block_clock_record(), MARK_END);
    }
};

// Step k's marks (in a kernel holding a BlockClock): its bytes in (`products` false) or its products done.
__device__ __forceinline__ void clock_step(int k, bool products) {
    if (threadIdx.x == 0 && k < CLOCK_STEPS) stamp(block_clock_record(), MARK_STEP + 2 * k + (int)products);
}
#else
struct BlockClocks;
__device__ __forceinline__ BlockClocks* clock_wait_begins() { return nullptr; }
__device__ __forceinline__ void clock_wait_ends(BlockClocks*) {}
struct BlockClock {
    __device__ __forceinline__ BlockClock() {}
    __device__ __forceinline__ ~BlockClock() {}
};
__device__ __forceinline__ void clock_step(int, bool) {}
#endif
