/*
 * handles.c - open-addressing hash tables, one per handle kind, mapping a
 * handle to (size, gpu record) so that a free is credited to the
 * allocation's own device and by exactly what was charged. Lock-free:
 * the alloc/free hot path costs one CAS here. Tables are anonymous
 * MAP_NORESERVE mappings: only touched pages use memory.
 */
#define _GNU_SOURCE
#include "handles.h"

#include <string.h>
#include <sys/mman.h>

#include "vcuda.h"

#define TOMB UINT64_MAX
#define BUSY (UINT64_MAX - 1) /* claimed, value being written */
#define SIZE_MASK ((1ULL << 56) - 1)

/* Two tiers per kind. The small first tier (16 bytes an entry) stays in
 * cache and takes nearly every handle; the big second tier is only touched
 * when the first is crowded. Probes are bounded in both, so a lookup of an
 * unknown handle costs at most P0 + P1 probes however many tombstones pile
 * up. */
#define P0 32
#define P1 128
static const unsigned tier_bits[VC_K_COUNT][2] = {
    [VC_K_PTR] = {16, 20},   [VC_K_ARRAY] = {12, 18}, [VC_K_MIPMAP] = {10, 16},
    [VC_K_GENERIC] = {14, 19}, [VC_K_IPC] = {10, 16},  [VC_K_EXTMEM] = {8, 14},
    [VC_K_POOLPTR] = {16, 20}, [VC_K_LIMIT] = {6, 10},
    [VC_K_CTX] = {8, 12},    [VC_K_GREEN] = {6, 10},  [VC_K_GRAPH] = {10, 14},
    [VC_K_GRAPHEXEC] = {10, 14}, [VC_K_MODULE] = {12, 16},
};

static vc_entry *tables[VC_K_COUNT][2];
static _Atomic int tier1_used[VC_K_COUNT]; /* a context sweep skips unused tiers */

int vc_handles_init(void) {
    for (int k = 0; k < VC_K_COUNT; k++)
        for (int t = 0; t < 2; t++) {
            size_t sz = sizeof(vc_entry) << tier_bits[k][t];
            void *m = mmap(NULL, sz, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (m == MAP_FAILED)
                return -1;
            tables[k][t] = m;
        }
    return 0;
}

void vc_handles_atfork_child(void) {
    /* Device handles do not survive fork; start empty. Map fresh zero pages
     * over the tables rather than clearing them: a memset would make every
     * forked child touch (and own) all of their pages. */
    for (int k = 0; k < VC_K_COUNT; k++) {
        atomic_store(&tier1_used[k], 0);
        for (int t = 0; t < 2; t++) {
            size_t sz = sizeof(vc_entry) << tier_bits[k][t];
            if (tables[k][t] &&
                mmap(tables[k][t], sz, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
                memset(tables[k][t], 0, sz);
        }
    }
}

static inline uint64_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

int vc_track_ctx(int kind, uint64_t key, uint64_t size, int gpu, uint64_t ctx) {
    if (key == 0 || key >= BUSY || size > SIZE_MASK || gpu < -8 || gpu > 200)
        return -1;
    uint64_t val = size | ((uint64_t)(gpu + 8) << 56), h = hash(key);
    for (int t = 0; t < 2; t++) {
        vc_entry *e = tables[kind][t];
        uint64_t mask = (1ULL << tier_bits[kind][t]) - 1, i = h & mask;
        for (int n = 0; n < (t ? P1 : P0); n++, i = (i + 1) & mask) {
            uint64_t cur = atomic_load_explicit(&e[i].key, memory_order_relaxed);
            if (cur != 0 && cur != TOMB)
                continue;
            /* Claim the slot, fill it, then publish the key: whoever sees
             * the key (a context sweep on another thread) sees its value. */
            if (atomic_compare_exchange_strong(&e[i].key, &cur, BUSY)) {
                e[i].val = val;
                e[i].ctx = ctx;
                atomic_store_explicit(&e[i].key, key, memory_order_release);
                if (t == 1 && !atomic_load_explicit(&tier1_used[kind], memory_order_relaxed))
                    atomic_store(&tier1_used[kind], 1);
                return 0;
            }
        }
    }
    return -1;
}

static vc_entry *find(int kind, uint64_t key) {
    uint64_t h = hash(key);
    for (int t = 0; t < 2; t++) {
        vc_entry *e = tables[kind][t];
        uint64_t mask = (1ULL << tier_bits[kind][t]) - 1, i = h & mask;
        for (int n = 0; n < (t ? P1 : P0); n++, i = (i + 1) & mask) {
            uint64_t cur = atomic_load_explicit(&e[i].key, memory_order_acquire);
            if (cur == key)
                return &e[i];
            if (cur == 0)
                break;
        }
    }
    return NULL;
}

static void unpack(uint64_t val, uint64_t *size, int *gpu) {
    *size = val & SIZE_MASK;
    *gpu = (int)(val >> 56) - 8;
}

int vc_lookup(int kind, uint64_t key, uint64_t *size, int *gpu) {
    if (key == 0 || key >= BUSY || !tables[kind][0])
        return -1;
    vc_entry *e = find(kind, key);
    if (!e)
        return -1;
    unpack(e->val, size, gpu);
    return 0;
}

int vc_lookup_ctx(int kind, uint64_t key, uint64_t *size, int *gpu, uint64_t *ctx) {
    if (key == 0 || key >= BUSY || !tables[kind][0])
        return -1;
    vc_entry *e = find(kind, key);
    if (!e)
        return -1;
    unpack(e->val, size, gpu);
    *ctx = e->ctx;
    return 0;
}

int vc_set_ctx(int kind, uint64_t key, uint64_t ctx) {
    if (key == 0 || key >= BUSY || !tables[kind][0])
        return -1;
    vc_entry *e = find(kind, key);
    if (!e)
        return -1;
    e->ctx = ctx;
    return 0;
}

int vc_untrack(int kind, uint64_t key, uint64_t *size, int *gpu, uint64_t *ctx) {
    if (key == 0 || key >= BUSY || !tables[kind][0])
        return -1;
    for (;;) {
        vc_entry *e = find(kind, key);
        if (!e)
            return -1;
        uint64_t val = e->val, c = e->ctx, expect = key;
        if (atomic_compare_exchange_strong(&e->key, &expect, TOMB)) {
            unpack(val, size, gpu);
            if (ctx)
                *ctx = c;
            return 0;
        }
        /* Lost a race with a double free on another thread: look again. */
    }
}

void vc_untrack_ctx(uint64_t ctx, void (*fn)(int kind, uint64_t size, int gpu)) {
    if (!ctx)
        return;
    for (int k = 0; k < VC_K_COUNT; k++) {
        if (k == VC_K_POOLPTR || k == VC_K_GENERIC || k == VC_K_GRAPH || k == VC_K_GRAPHEXEC)
            continue; /* device memory: never bound to a context */
        for (int t = 0; t < 2; t++) {
            vc_entry *e = tables[k][t];
            if (!e || (t == 1 && !atomic_load(&tier1_used[k])))
                continue;
            for (uint64_t i = 0; i < (1ULL << tier_bits[k][t]); i++) {
                uint64_t key = atomic_load_explicit(&e[i].key, memory_order_acquire);
                if (key == 0 || key == TOMB || key == BUSY || e[i].ctx != ctx)
                    continue;
                uint64_t val = e[i].val;
                if (atomic_compare_exchange_strong(&e[i].key, &key, TOMB)) {
                    uint64_t size;
                    int gpu;
                    unpack(val, &size, &gpu);
                    fn(k, size, gpu);
                }
            }
        }
    }
}
