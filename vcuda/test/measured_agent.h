/*
 * measured_agent.h - the node agent's double for the compute limiter's
 * measured file (contract: src/limits.h, vc_measured_parse): what the agent
 * publishes per container from NVML's per-process SM utilisation, here from
 * the fake driver's exact per-process busy time (fakeProcessBusy) quantised
 * as NVML reports it. Used by the limiter's cases and the grid alike.
 */
#ifndef VCUDA_MEASURED_AGENT_H
#define VCUDA_MEASURED_AGENT_H

#include <stdint.h>
#include <sys/types.h>

#define MEASURED_AGENT_MAX 8
#define MEASURED_AGENT_PERIOD_NS 200000000ull

typedef struct {
    int dev;            /* fake device ordinal ... */
    const char *uuid;   /* ... and the UUID the limits files name */
    uint64_t period_ns; /* one NVML sample and one write a period */
    uint64_t deadline;  /* CLOCK_MONOTONIC ns: the agent stops then */
    int n;
    const char *dir[MEASURED_AGENT_MAX]; /* container i's vcuda directory (its limits file's) */
    pid_t pid[MEASURED_AGENT_MAX];       /* ... and its process */
} measured_agent;

/* Starts the double as a child process (spawn(): it dies with the caller),
 * once the containers' processes exist. Every period it writes, for each
 * container, <dir>/measured/compute atomically (temp file + rename). */
pid_t measured_agent_start(measured_agent *a);
/* Field 22 of /proc/<pid>/stat, as the agent names a process (0: gone). */
unsigned long long measured_agent_start_time(pid_t pid);

#endif
