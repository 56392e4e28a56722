/*
 * measured_agent.c - the node agent's double: the measured compute file.
 *
 * Mirrors the agent and NVML: per process and GPU, busy is the sum over
 * samples of SmUtil/100 x the sample's period, SmUtil a whole percent,
 * truncated (NVML's rounding is not documented: truncation is the unkind
 * choice, a process measured below what it ran, so the container is granted
 * more), read as the agent reads it: half a point more between 0 and 100;
 * the first sample of a process only sets its baseline (busy 0); a process
 * appears once it has run a kernel; at is the end of the newest
 * sample, host CLOCK_MONOTONIC; the line names the process by pid and its
 * start time (field 22 of /proc/<pid>/stat); the file is replaced whole
 * (rename). Does not mirror: NVML's sample period is the driver's (about
 * 1/6 s) and its timestamps wall-clock microseconds the agent converts; here
 * a sample is one write period of the double and its time is exact; the
 * busy time is the fake's exact per-process union (fakeProcessBusy), where a
 * driver samples SM activity. Shares nothing with vcuda's limiter.
 */
#define _GNU_SOURCE
#include "measured_agent.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "fake.h"
#include "util.h"

/* /proc/<pid>/stat field 22, after the parenthesised command name */
unsigned long long measured_agent_start_time(pid_t pid) {
    char p[64], s[1024];
    snprintf(p, sizeof(p), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(p, "r");
    if (!f)
        return 0;
    size_t n = fread(s, 1, sizeof(s) - 1, f);
    fclose(f);
    s[n] = '\0';
    char *c = strrchr(s, ')');
    unsigned long long v = 0;
    int field = 2;
    for (char *t = c ? strtok(c + 1, " ") : NULL; t; t = strtok(NULL, " "))
        if (++field == 22) {
            v = strtoull(t, NULL, 10);
            break;
        }
    return v;
}

typedef struct {
    int seen;
    unsigned long long start;
    uint64_t exact, t; /* the previous sample's */
    uint64_t busy, at; /* what is published */
} agent_proc;

static int agent_run(int i, void *arg) {
    (void)i;
    measured_agent *a = arg;
    agent_proc pr[MEASURED_AGENT_MAX] = {{0}};
    for (int k = 0; k < a->n; k++) {
        char d[4200];
        snprintf(d, sizeof(d), "%s/measured", a->dir[k]);
        CHECK(mkdir(d, 0755) == 0 || errno == EEXIST, "mkdir %s: %s", d, strerror(errno));
        pr[k].start = measured_agent_start_time(a->pid[k]);
    }
    for (uint64_t next = now_ns(); now_ns() < a->deadline; next += a->period_ns) {
        for (int k = 0; k < a->n; k++) {
            uint64_t b = 0, t = 0;
            agent_proc *p = &pr[k];
            if (fakeProcessBusy(a->dev, a->pid[k], &b, &t) == 0) {
                if (!p->seen && b > 0) {
                    *p = (agent_proc){1, p->start, b, t, 0, t};
                } else if (p->seen && t > p->t) {
                    uint64_t dt = t - p->t, pct = (b - p->exact) * 100 / dt; /* truncated */
                    if (pct > 100)
                        pct = 100;
                    /* the agent reads a whole percent between 0 and 100 as
                     * half a point more (internal/memguard, PeriodBusyNs) */
                    p->busy += (pct * 2 + (pct > 0 && pct < 100)) * dt / 200;
                    p->exact = b, p->t = t, p->at = t;
                }
            }
            char text[512], tmp[4200], dst[4200];
            int m = snprintf(text, sizeof(text), "tessera-compute-measured 1\nwritten %llu\n",
                             (unsigned long long)now_ns());
            if (p->seen)
                snprintf(text + m, sizeof(text) - (size_t)m, "gpu %s pid %d start %llu busy %llu at %llu\n", a->uuid,
                         (int)a->pid[k], p->start, (unsigned long long)p->busy, (unsigned long long)p->at);
            snprintf(tmp, sizeof(tmp), "%s/measured/.compute.tmp", a->dir[k]);
            snprintf(dst, sizeof(dst), "%s/measured/compute", a->dir[k]);
            write_file(tmp, text);
            CHECK(rename(tmp, dst) == 0, "rename %s: %s", dst, strerror(errno));
        }
        uint64_t now = now_ns();
        if (next + a->period_ns > now) {
            uint64_t w = next + a->period_ns - now;
            struct timespec ts = {(time_t)(w / 1000000000ull), (long)(w % 1000000000ull)};
            nanosleep(&ts, NULL);
        }
    }
    return 0;
}

pid_t measured_agent_start(measured_agent *a) {
    CHECK(a->n > 0 && a->n <= MEASURED_AGENT_MAX, "%d containers", a->n);
    return spawn(agent_run, 0, a);
}
