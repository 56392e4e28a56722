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

static const unsigned table_bits[VC_K_COUNT] = {
    [VC_K_PTR] = 20, [VC_K_ARRAY] = 16, [VC_K_MIPMAP] = 14, [VC_K_GENERIC] = 18,
    [VC_K_IPC] = 14, [VC_K_EXTMEM] = 12, [VC_K_POOL] = 10,
};

static vc_entry *tables[VC_K_COUNT];

int vc_handles_init(void) {
    for (int k = 0; k < VC_K_COUNT; k++) {
        size_t sz = sizeof(vc_entry) << table_bits[k];
        void *m = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED)
            return -1;
        tables[k] = m;
    }
    return 0;
}

void vc_handles_atfork_child(void) {
    /* Device handles do not survive fork; start empty. */
    for (int k = 0; k < VC_K_COUNT; k++)
        if (tables[k])
            memset(tables[k], 0, sizeof(vc_entry) << table_bits[k]);
}

static inline uint64_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

int vc_track(int kind, uint64_t key, uint64_t size, int gpu) {
    vc_entry *t = tables[kind];
    uint64_t mask = (1ULL << table_bits[kind]) - 1;
    uint64_t i = hash(key) & mask;
    for (uint64_t n = 0; n <= mask; n++, i = (i + 1) & mask) {
        uint64_t cur = atomic_load_explicit(&t[i].key, memory_order_relaxed);
        if (cur != 0 && cur != TOMB)
            continue;
        if (atomic_compare_exchange_strong(&t[i].key, &cur, key)) {
            /* Only the thread that got the handle back looks it up again, and
             * it does so after this store, so plain stores suffice. */
            t[i].size = size;
            t[i].gpu = gpu;
            return 0;
        }
    }
    return -1;
}

static vc_entry *find(int kind, uint64_t key) {
    vc_entry *t = tables[kind];
    uint64_t mask = (1ULL << table_bits[kind]) - 1;
    uint64_t i = hash(key) & mask;
    for (uint64_t n = 0; n <= mask; n++, i = (i + 1) & mask) {
        uint64_t cur = atomic_load_explicit(&t[i].key, memory_order_acquire);
        if (cur == key)
            return &t[i];
        if (cur == 0)
            return NULL;
    }
    return NULL;
}

int vc_lookup(int kind, uint64_t key, uint64_t *size, int *gpu) {
    if (key == 0 || key == TOMB || !tables[kind])
        return -1;
    vc_entry *e = find(kind, key);
    if (!e)
        return -1;
    *size = e->size;
    *gpu = e->gpu;
    return 0;
}

int vc_untrack(int kind, uint64_t key, uint64_t *size, int *gpu) {
    if (key == 0 || key == TOMB || !tables[kind])
        return -1;
    for (;;) {
        vc_entry *e = find(kind, key);
        if (!e)
            return -1;
        uint64_t sz = e->size;
        int g = e->gpu;
        uint64_t expect = key;
        if (atomic_compare_exchange_strong(&e->key, &expect, TOMB)) {
            *size = sz;
            *gpu = g;
            return 0;
        }
        /* Lost a race with a double free on another thread: look again. */
    }
}
