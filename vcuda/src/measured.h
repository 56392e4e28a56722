/* measured.h - the compute limiter's reference from the driver: the node
 * agent's measured compute file (measured.c). */
#ifndef VCUDA_MEASURED_H
#define VCUDA_MEASURED_H

#include <stdatomic.h>
#include <stdint.h>

#include "limits.h"

/* Per GPU record: what this process's charges are multiplied by (0: not
 * measured, i.e. 1), and its raw charge (before that factor) so far. */
extern _Atomic double vc_meas_factor[VC_MAX_GPUS];
extern _Atomic uint64_t vc_meas_raw[VC_MAX_GPUS];
/* The earliest time the file is read again. */
extern _Atomic uint64_t vc_meas_next;

/* The limits file in use: the measured file is <its directory>/measured/compute. */
void vc_measured_init(const char *limits_path);
/* Reads the file and updates the factors (called at most every ~50 ms). */
void vc_measured_refresh(uint64_t now);
/* In a forked child: a new process, nothing measured of it yet. */
void vc_measured_atfork_child(void);

static inline double vc_measured_factor(int g) {
    double f = atomic_load_explicit(&vc_meas_factor[g], memory_order_relaxed);
    return f != 0 ? f : 1;
}
/* On the launch path, with a clock reading it already has: one load and a
 * compare until the next read is due. */
static inline void vc_measured_tick(uint64_t now) {
    if (__builtin_expect(now >= atomic_load_explicit(&vc_meas_next, memory_order_relaxed), 0))
        vc_measured_refresh(now);
}

#endif
