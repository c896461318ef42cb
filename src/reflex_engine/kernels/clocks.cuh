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
// tools/probe_clocks.py reads this layout (its RECORD dtype): 136 bytes.
struct BlockClocks {
    uint64_t grid;  // %gridid: which launch
    uint32_t block, sm, blocks, pad;  // the block's linear index, its SM, the launch's blocks
    uint64_t wait_ns, followed_ns;  // %globaltimer at MARK_WAIT and MARK_FOLLOWED
    uint32_t marks[CLOCK_MARKS];  // %clock at each mark, | 1 (0: not marked); the probe zeroes them before a run
};
static_assert(sizeof(BlockClocks) == 136, "tools/probe_clocks.py's RECORD");
constexpr unsigned CLOCK_RECORDS = 1u << 17;  // a decode step's blocks, and room to spare
__device__ BlockClocks reflex_clocks[CLOCK_RECORDS];
__device__ unsigned reflex_clocks_used;  // records taken; the probe zeroes it before a run

// The calling block's record, taken at its first mark; null past CLOCK_RECORDS. Thread 0 only.
__device__ __forceinline__ BlockClocks* clock_record() {
    __shared__ BlockClocks* record;
    __shared__ uint64_t owner;  // the (launch, block) `record` belongs to: shared memory outlives a block
    uint64_t grid;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    const uint32_t block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const uint64_t me = grid << 32 | block;
    if (owner != me) {
        owner = me;
        const unsigned i = atomicAdd(&reflex_clocks_used, 1u);
        record = i < CLOCK_RECORDS ? &reflex_clocks[i] : nullptr;
        if (record) {
            uint32_t sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            record->grid = grid, record->block = block, record->sm = sm;
            record->blocks = gridDim.x * gridDim.y * gridDim.z;
        }
    }
    return record;
}

__device__ __forceinline__ void clock_mark(int mark) {
    if (threadIdx.x != 0 || mark >= CLOCK_MARKS) return;
    BlockClocks* r = clock_record();
    if (!r) return;
    r->marks[mark] = (uint32_t)clock() | 1u;
    if (mark == MARK_WAIT || mark == MARK_FOLLOWED) {
        uint64_t ns;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
        (mark == MARK_WAIT ? r->wait_ns : r->followed_ns) = ns;
    }
}
#else
__device__ __forceinline__ void clock_mark(int) {}
#endif

// Step k's marks: its bytes in (`products` false) or its products done.
__device__ __forceinline__ void clock_step(int k, bool products) { clock_mark(MARK_STEP + 2 * k + (int)products); }

// A kernel's start and end, held for its body: `const BlockClock clocked;` as its first statement.
struct BlockClock {
    __device__ __forceinline__ BlockClock() { clock_mark(MARK_START); }
    __device__ __forceinline__ ~BlockClock() { clock_mark(MARK_END); }
};
