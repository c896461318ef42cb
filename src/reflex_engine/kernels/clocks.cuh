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
    MARK_END,  // its last warp was done (a kernel holding a BlockClock)
    MARK_STEP,  // step k: MARK_STEP + 2k its bytes in, MARK_STEP + 2k + 1 its products done
};
constexpr int CLOCK_STEPS = 10;
constexpr int CLOCK_MARKS = MARK_STEP + 2 * CLOCK_STEPS;

#ifdef REFLEX_CLOCKS
// tools/probe_clocks.py reads this layout (its RECORD dtype): 128 bytes. A block holding a BlockClock writes two
// records, its wait's and its own marks' (the probe joins them): the wait's is kept in a register across it, since
// shared memory for it in every kernel would not fit one of 48 KB of static shared memory (gemm_f16_128).
struct BlockClocks {
    uint64_t grid;  // %gridid: which launch
    uint32_t block, sm;  // the block's linear index, its SM
    uint64_t wait_ns, followed_ns;  // %globaltimer at MARK_WAIT and MARK_FOLLOWED
    uint32_t marks[CLOCK_MARKS];  // %clock at each mark, | 1 (0: not marked); the probe zeroes them before a run
};
static_assert(sizeof(BlockClocks) == 128, "tools/probe_clocks.py's RECORD");
constexpr unsigned CLOCK_RECORDS = 1u << 18;  // a decode step's blocks, twice for some, and room to spare
__device__ BlockClocks reflex_clocks[CLOCK_RECORDS];
__device__ unsigned reflex_clocks_used;  // records taken; the probe zeroes it before a run

// A new record of the calling block (thread 0) in slot i, null past CLOCK_RECORDS.
__device__ __forceinline__ BlockClocks* clock_record(unsigned i) {
    if (i >= CLOCK_RECORDS) return nullptr;
    BlockClocks* r = &reflex_clocks[i];
    uint64_t grid;
    uint32_t sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r->grid = grid, r->block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x, r->sm = sm;
    return r;
}

__device__ __forceinline__ unsigned clock_slot() { return atomicAdd(&reflex_clocks_used, 1u); }
__device__ __forceinline__ uint32_t clock_now() { return (uint32_t)clock() | 1u; }
__device__ __forceinline__ uint64_t global_ns() {
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}

// The wait for the kernel before (common.cuh follow_previous_kernel), thread 0's: its slot asked for before it and
// read after, so that the atomic's answer comes while the block waits anyway.
struct WaitClock {
    unsigned slot;
    uint32_t clock;
    uint64_t ns;
};
__device__ __forceinline__ WaitClock clock_wait_begins() {
    if (threadIdx.x != 0) return {};
    const unsigned slot = clock_slot();
    return {slot, clock_now(), global_ns()};
}
__device__ __forceinline__ void clock_wait_ends(const WaitClock& w) {
    if (threadIdx.x != 0) return;
    const uint32_t followed = clock_now();
    const uint64_t followed_ns = global_ns();
    BlockClocks* r = clock_record(w.slot);
    if (!r) return;
    r->marks[MARK_WAIT] = w.clock, r->marks[MARK_FOLLOWED] = followed;
    r->wait_ns = w.ns, r->followed_ns = followed_ns;
}

// A BlockClock's marks until its end, when they go to a record: taking one waits for an atomic's answer, which the
// block's start (a bulk matvec's first copies) should not. Thread 0 writes them, but for MARK_END.
__device__ __forceinline__ uint32_t* block_clock_marks() {
    __shared__ uint32_t marks[CLOCK_MARKS];
    return marks;
}
__device__ __forceinline__ unsigned& block_clock_exits() {  // the block's warps past their BlockClock
    __shared__ unsigned exits;
    return exits;
}

// A kernel's start and end, held for its body: `const BlockClock clocked;` as its first statement. Its end is the
// block's last warp's (a bulk matvec's storing warp ends after thread 0), which then writes the record.
struct BlockClock {
    __device__ __forceinline__ BlockClock() {
        if (threadIdx.x != 0) return;
        uint32_t* marks = block_clock_marks();
        for (int i = 0; i < CLOCK_MARKS; ++i) marks[i] = 0;
        block_clock_exits() = 0;
        marks[MARK_START] = clock_now();
    }
    __device__ __forceinline__ ~BlockClock() {
        if (threadIdx.x % WARP != 0) return;
        uint32_t* marks = block_clock_marks();
        atomicMax(&marks[MARK_END], clock_now());
        __threadfence_block();
        if (atomicAdd(&block_clock_exits(), 1u) != blockDim.x / WARP - 1) return;
        __threadfence_block();
        BlockClocks* r = clock_record(clock_slot());
        if (r)
            for (int i = 0; i < CLOCK_MARKS; ++i) r->marks[i] = marks[i];
    }
};

// Step k's marks (in a kernel holding a BlockClock): its bytes in (`products` false) or its products done.
__device__ __forceinline__ void clock_step(int k, bool products) {
    if (threadIdx.x == 0 && k < CLOCK_STEPS) block_clock_marks()[MARK_STEP + 2 * k + (int)products] = clock_now();
}
#else
struct WaitClock {};
__device__ __forceinline__ WaitClock clock_wait_begins() { return {}; }
__device__ __forceinline__ void clock_wait_ends(const WaitClock&) {}
struct BlockClock {
    __device__ __forceinline__ BlockClock() {}
    __device__ __forceinline__ ~BlockClock() {}
};
__device__ __forceinline__ void clock_step(int, bool) {}
#endif
