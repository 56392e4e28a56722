/*
 * region.c - cross-process accounting in the shared region.
 *
 * Hot path (vc_reserve/vc_release): lock-free. A process owns one slot; an
 * update is bracketed by inflight++/-- on that slot and is one CAS on the
 * device's `used` word plus one add on the slot's per-device counter:
 *   inflight++ ; CAS used: t -> t+size (fails over cap or if FROZEN) ;
 *   slot.used[g] += size ; inflight--
 * Invariant at rest: used[g] == sum over live slots of slot.used[g].
 *
 * Crash safety: a process can die anywhere, including between the CAS and the
 * slot update, so a dead slot's counters cannot be trusted to say what it
 * contributed. Reclaim therefore never subtracts; it recomputes: under an
 * flock on the region file (the kernel drops it if the reclaimer dies), it
 * sets FROZEN on every used word (so no CAS can land), waits until every live
 * slot's inflight is 0 (those threads either finished or saw FROZEN and backed
 * off), frees the dead slots and stores used[g] = sum of live slots, which
 * also clears FROZEN. A thread that meets FROZEN takes the flock itself: if
 * the reclaimer died, it finds FROZEN still set under the lock and finishes
 * the recompute.
 */
#define _GNU_SOURCE
#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vcuda.h"

static struct {
    char path[4096];
    int fd;
    int reopen; /* after fork: the inherited fd shares the parent's flock */
    unsigned char *base;
    vc_region_hdr *hdr;
    vc_region_gpu *gpu;
    vc_region_slot *slot;
    int ngpus;
    uint64_t cap[VC_MAX_GPUS];
    vc_region_slot *_Atomic me; /* this process's slot, NULL until first reservation */
    int my_index;
    pid_t pid;
    uint64_t starttime;
    uint64_t pidns; /* this process's PID namespace (pid_ns()) */
    int claim_failed;
    _Atomic uint64_t last_info_reclaim;
} R = {.fd = -1, .my_index = -1};

static pthread_mutex_t R_mu = PTHREAD_MUTEX_INITIALIZER;
/* Serialises this process's updates of its slot's ctx[] (contexts are slow path). */
static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;

static void clear_ctx(vc_region_slot *sl) {
    for (int i = 0; i < VC_CTX_RECS; i++)
        atomic_store(&sl->ctx[i], 0);
}

#define VC_LOCK_WAIT_NS 2000000000ull

/* /proc/<pid>/stat: state (field 3) and starttime (field 22). */
int vc_proc_stat(pid_t pid, char *state, uint64_t *starttime) {
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ESRCH ? 0 : -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* comm may contain spaces and parens */
    if (!p || p[1] != ' ')
        return -1;
    p += 2;
    *state = *p;
    /* p is field 3; skip to field 22. */
    for (int f = 3; f < 22; f++) {
        p = strchr(p, ' ');
        if (!p)
            return -1;
        p++;
    }
    *starttime = strtoull(p, NULL, 10);
    return 1;
}

/* The PID namespace this process is in: the inode of /proc/self/ns/pid
 * (nsfs), 0 if it cannot be read. */
static uint64_t pid_ns(void) {
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

/* Whether slot s's pid means, to this process, the process that owns it:
 * the owner is in this process's PID namespace. A region shared by the
 * containers of a DRA claim holds slots of other namespaces, whose pids may
 * equal ours or name unrelated processes here. */
static int slot_in_my_ns(int s) { return R.pidns != 0 && R.slot[s].pidns == R.pidns; }

/*
 * Liveness: each process holds an open-file-description lock on one byte
 * past the end of the region's mapping (VC_REGION_SIZE + slot) for as long
 * as it owns the slot. The kernel drops the lock when the process dies (its
 * last reference to the description closes), whatever PID namespace the
 * owner or the checker is in, and a reused pid cannot inherit it. The pid
 * and start time are kept for display and as a fallback where OFD locks
 * are not available.
 */
static int live_lock(int fd, int slot, short type, int cmd) {
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(VC_REGION_SIZE + (uint64_t)slot);
    fl.l_len = 1;
    if (fcntl(fd, cmd, &fl) != 0)
        return -1;
    return cmd == F_OFD_GETLK ? fl.l_type != F_UNLCK : 0;
}

/* 1 = alive (or cannot tell), 0 = dead. */
static int proc_alive(pid_t pid, uint64_t starttime);
static int slot_alive(int s) {
    int held = live_lock(R.fd, s, F_WRLCK, F_OFD_GETLK);
    if (held >= 0)
        return held;
    if (!slot_in_my_ns(s))
        return 1; /* its pid names nobody we can check: cannot tell */
    return proc_alive((pid_t)atomic_load(&R.slot[s].pid), R.slot[s].starttime);
}

static int proc_alive(pid_t pid, uint64_t starttime) {
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char st = 0;
    uint64_t t = 0;
    int r = vc_proc_stat(pid, &st, &t);
    if (r == 0)
        return 0;
    if (r < 0)
        return 1;
    if (st == 'Z' || st == 'X' || st == 'x')
        return 0;
    if (starttime && t != starttime)
        return 0; /* pid reused by another process */
    return 1;
}

static int lock_region(void) {
    pthread_mutex_lock(&R_mu);
    if (R.reopen) {
        int fd = open(R.path, O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            close(R.fd);
            R.fd = fd;
            R.reopen = 0;
        }
    }
    /* Never wait forever: the kernel drops the lock of a dead holder, but a
     * stopped one (SIGSTOP, a frozen cgroup) keeps it. After the deadline the
     * caller fails closed (an allocation is refused) and retries later. */
    uint64_t deadline = vc_now_ns() + VC_LOCK_WAIT_NS;
    unsigned naps = 0;
    while (flock(R.fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) {
            vc_log("flock %s: %s", R.path, strerror(errno));
            pthread_mutex_unlock(&R_mu);
            return -1;
        }
        if (vc_now_ns() > deadline) {
            static _Atomic int logged;
            if (!atomic_exchange(&logged, 1))
                vc_log("%s: region lock held for over %llu ms (a stopped process?); failing closed", R.path,
                       (unsigned long long)(VC_LOCK_WAIT_NS / 1000000));
            pthread_mutex_unlock(&R_mu);
            return -1;
        }
        struct timespec ts = {0, naps++ < 100 ? 20000 : 1000000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

static void unlock_region(void) {
    flock(R.fd, LOCK_UN);
    pthread_mutex_unlock(&R_mu);
}

int vc_region_open(const vc_limits *l) {
    snprintf(R.path, sizeof(R.path), "%s", l->region);
    R.pid = getpid();
    R.pidns = pid_ns();
    char st;
    if (vc_proc_stat(R.pid, &st, &R.starttime) <= 0)
        R.starttime = 0;
    R.ngpus = l->ngpus;
    for (int i = 0; i < l->ngpus; i++)
        R.cap[i] = l->gpu[i].mem_cap;

    R.fd = open(R.path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (R.fd < 0) {
        vc_log("%s: open region: %s", R.path, strerror(errno));
        return -1;
    }
    /* The lock guards creating the header. A region already built (its header
     * never changes after the magic is written) can be joined without it,
     * so a stopped lock holder does not turn a new process fail-closed. */
    int locked = lock_region() == 0;
    int rc = -1;
    struct stat sb;
    if (fstat(R.fd, &sb) != 0) {
        vc_log("%s: stat region: %s", R.path, strerror(errno));
        goto out;
    }
    int fresh = sb.st_size == 0;
    if (!locked && (uint64_t)sb.st_size < VC_REGION_SIZE)
        goto out;
    if ((uint64_t)sb.st_size < VC_REGION_SIZE && ftruncate(R.fd, (off_t)VC_REGION_SIZE) != 0) {
        vc_log("%s: size region: %s", R.path, strerror(errno));
        goto out;
    }
    void *m = mmap(NULL, VC_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, R.fd, 0);
    if (m == MAP_FAILED) {
        vc_log("%s: map region: %s", R.path, strerror(errno));
        goto out;
    }
    R.base = m;
    R.hdr = m;
    R.gpu = (vc_region_gpu *)(R.base + VC_REGION_GPU_OFFSET);
    R.slot = (vc_region_slot *)(R.base + VC_REGION_SLOT_OFFSET);

    if (!locked && (fresh || R.hdr->magic == 0))
        goto out; /* cannot build it without the lock */
    if (fresh || R.hdr->magic == 0) {
        /* New file (zero-filled by ftruncate). The magic is written last so a
         * reader never sees a half-built header as valid; we hold the flock. */
        R.hdr->version = VC_REGION_VERSION;
        R.hdr->header_size = sizeof(vc_region_hdr);
        R.hdr->total_size = VC_REGION_SIZE;
        R.hdr->nslots = VC_MAX_SLOTS;
        R.hdr->gpu_offset = VC_REGION_GPU_OFFSET;
        R.hdr->gpu_size = sizeof(vc_region_gpu);
        R.hdr->slot_offset = VC_REGION_SLOT_OFFSET;
        R.hdr->slot_size = sizeof(vc_region_slot);
        snprintf(R.hdr->container, sizeof(R.hdr->container), "%s", l->container);
        R.hdr->ngpus = (uint32_t)l->ngpus;
        for (int i = 0; i < l->ngpus; i++) {
            snprintf(R.gpu[i].uuid, sizeof(R.gpu[i].uuid), "%s", l->gpu[i].uuid);
            R.gpu[i].mem_cap = l->gpu[i].mem_cap;
            R.gpu[i].cores = l->gpu[i].cores;
        }
        atomic_thread_fence(memory_order_release);
        R.hdr->magic = VC_REGION_MAGIC;
    } else if (R.hdr->magic != VC_REGION_MAGIC || R.hdr->version != VC_REGION_VERSION ||
               R.hdr->total_size != VC_REGION_SIZE) {
        vc_log("%s: not a vcuda region of version %d", R.path, VC_REGION_VERSION);
        goto out;
    } else {
        /* Every process of the container reads the same limits file, so the
         * gpu table must match record for record. */
        if ((int)R.hdr->ngpus != l->ngpus) {
            vc_log("%s: region lists %u gpus, limits file %d", R.path, R.hdr->ngpus, l->ngpus);
            goto out;
        }
        for (int i = 0; i < l->ngpus; i++) {
            if (strcmp(R.gpu[i].uuid, l->gpu[i].uuid) != 0) {
                vc_log("%s: region gpu %d is %s, limits file says %s", R.path, i, R.gpu[i].uuid,
                       l->gpu[i].uuid);
                goto out;
            }
        }
    }
    rc = 0;
out:
    if (locked)
        unlock_region();
    return rc;
}

vc_region_gpu *vc_region_gpu_rec(int g) { return &R.gpu[g]; }

/* ---- contexts per slot (slot.ctx[], for the node agent) ---- */

void vc_region_ctx_note(int g, int delta, uint64_t bytes) {
    vc_region_slot *me = atomic_load(&R.me);
    if (!me || g < 0 || g >= VC_MAX_GPUS || (delta != 1 && delta != -1))
        return;
    uint64_t pages = (bytes + VC_PAGE - 1) / VC_PAGE;
    pthread_mutex_lock(&ctx_mu);
    int at = -1, free_at = -1;
    for (int i = 0; i < VC_CTX_RECS; i++) {
        uint32_t w = atomic_load(&me->ctx[i]);
        if (w != 0 && VC_CTX_GPU(w) == g)
            at = i;
        else if (w == 0 && free_at < 0)
            free_at = i;
    }
    if (at < 0 && delta > 0)
        at = free_at; /* none free: this GPU goes unrecorded (the agent takes no sample) */
    if (at >= 0) {
        uint32_t w = atomic_load(&me->ctx[at]);
        uint64_t n = w ? VC_CTX_COUNT(w) : 0, p = w ? VC_CTX_PAGES(w) : 0;
        if (n != VC_CTX_SATURATED) {
            if (delta > 0) {
                n++;
                p += pages;
            } else {
                n = n ? n - 1 : 0;
                p = p > pages ? p - pages : 0;
            }
            if (n == 0)
                w = 0;
            else if (n >= VC_CTX_SATURATED || p > VC_CTX_MAX_PAGES)
                w = VC_CTX_WORD(g, VC_CTX_SATURATED, VC_CTX_MAX_PAGES);
            else
                w = VC_CTX_WORD(g, n, p);
            atomic_store(&me->ctx[at], w);
        }
    }
    pthread_mutex_unlock(&ctx_mu);
}

uint64_t vc_region_self_used(int g) {
    vc_region_slot *me = atomic_load(&R.me);
    return me ? atomic_load_explicit(&me->used[g], memory_order_relaxed) : 0;
}

uint64_t vc_region_used(int g) {
    return atomic_load_explicit(&R.gpu[g].used, memory_order_relaxed) & ~VC_FROZEN;
}

/* Recompute with every other live process quiescent; caller holds the lock.
 * dead[] marks slots to drop. Returns 0, or -1 if a live process stayed
 * inside an update for too long (e.g. it is stopped); totals are then left
 * as they were and the reclaim is retried later. */
static int recompute_locked(unsigned char *dead) {
    for (int g = 0; g < R.ngpus; g++)
        atomic_fetch_or(&R.gpu[g].used, VC_FROZEN);
    VC_TEST_PAUSE("reclaim");
    uint64_t deadline = vc_now_ns() + 2000000000ull;
    for (;;) {
        int busy = 0;
        for (int s = 0; s < VC_MAX_SLOTS; s++) {
            uint32_t pid = atomic_load(&R.slot[s].pid);
            if (pid == 0 || dead[s] || atomic_load(&R.slot[s].inflight) == 0)
                continue;
            if (&R.slot[s] != atomic_load(&R.me) && !slot_alive(s))
                dead[s] = 1; /* died inside an update */
            else
                busy = 1;
        }
        if (!busy)
            break;
        if (vc_now_ns() > deadline) {
            for (int g = 0; g < R.ngpus; g++)
                atomic_fetch_and(&R.gpu[g].used, ~VC_FROZEN);
            return -1;
        }
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    for (int s = 0; s < VC_MAX_SLOTS; s++) {
        if (!dead[s])
            continue;
        vc_region_slot *sl = &R.slot[s];
        for (int g = 0; g < VC_MAX_GPUS; g++)
            atomic_store(&sl->used[g], 0);
        atomic_store(&sl->inflight, 0);
        clear_ctx(sl);
        sl->starttime = 0;
        sl->pidns = 0;
        atomic_store(&sl->state, VC_SLOT_FREE);
        atomic_store(&sl->pid, 0);
    }
    for (int g = 0; g < R.ngpus; g++) {
        uint64_t sum = 0;
        for (int s = 0; s < VC_MAX_SLOTS; s++)
            if (atomic_load(&R.slot[s].pid) != 0)
                sum += atomic_load(&R.slot[s].used[g]);
        atomic_store(&R.gpu[g].used, sum); /* clears VC_FROZEN */
    }
    return 0;
}

int vc_region_reclaim(void) {
    if (!R.base)
        return 0;
    if (lock_region() != 0)
        return 0;
    unsigned char dead[VC_MAX_SLOTS];
    memset(dead, 0, sizeof(dead));
    int ndead = 0, frozen = 0;
    vc_region_slot *me = atomic_load(&R.me);
    for (int s = 0; s < VC_MAX_SLOTS; s++) {
        vc_region_slot *sl = &R.slot[s];
        uint32_t pid = atomic_load(&sl->pid);
        if (pid == 0 || sl == me)
            continue;
        if ((pid_t)pid == R.pid && slot_in_my_ns(s)) {
            /* Our own pid, in our PID namespace, on a slot that is not ours:
             * the image this process exec'ed from. It is gone. (The same pid
             * in another namespace is another container's process.) */
            dead[s] = 1;
        } else if (!slot_alive(s)) { /* its liveness lock is taken before its state is set */
            dead[s] = 1;
        }
        ndead += dead[s];
    }
    for (int g = 0; g < R.ngpus; g++)
        if (atomic_load(&R.gpu[g].used) & VC_FROZEN)
            frozen = 1; /* a reclaimer died half-way: finish its work */
    if ((ndead || frozen) && recompute_locked(dead) == 0 && ndead) {
        for (int g = 0; g < R.ngpus; g++)
            atomic_fetch_add(&R.gpu[g].reclaims, 1);
    } else {
        ndead = 0;
    }
    unlock_region();
    return ndead;
}

void vc_region_maybe_reclaim(void) {
    uint64_t now = vc_now_ns(), last = atomic_load(&R.last_info_reclaim);
    if (now - last < 200000000ull ||
        !atomic_compare_exchange_strong(&R.last_info_reclaim, &last, now))
        return;
    vc_region_reclaim();
}

/* Slow path: claim a slot for this process (first reservation). */
static vc_region_slot *claim_slot(void) {
    vc_region_slot *me = atomic_load(&R.me);
    if (me)
        return me;
    for (int attempt = 0; attempt < 2; attempt++) {
        int stale = 0;
        if (lock_region() != 0)
            return NULL;
        me = atomic_load(&R.me);
        if (me) {
            unlock_region();
            return me;
        }
        for (int s = 0; s < VC_MAX_SLOTS && !me; s++) {
            vc_region_slot *sl = &R.slot[s];
            uint32_t pid = atomic_load(&sl->pid);
            if ((pid_t)pid == R.pid && slot_in_my_ns(s))
                stale = 1;
            if (pid != 0)
                continue;
            /* the liveness lock first: a slot is never live without it */
            if (live_lock(R.fd, s, F_WRLCK, F_OFD_SETLK) != 0 && errno != EINVAL)
                continue;
            atomic_store(&sl->state, VC_SLOT_CLAIMING);
            clear_ctx(sl); /* an older vcuda's, or a crafted leftover */
            sl->pidns = R.pidns; /* before the pid: a pid is never read without its namespace */
            atomic_store(&sl->pid, (uint32_t)R.pid);
            sl->starttime = R.starttime;
            atomic_store(&sl->inflight, 0);
            atomic_store(&sl->state, VC_SLOT_LIVE);
            R.my_index = s;
            atomic_store(&R.me, sl);
            me = sl;
        }
        unlock_region();
        if (stale)
            vc_region_reclaim();
        if (me)
            return me;
        if (vc_region_reclaim() == 0)
            break;
    }
    if (!R.claim_failed) {
        R.claim_failed = 1;
        vc_log("%s: all %d process slots are taken; allocations refused", R.path, VC_MAX_SLOTS);
    }
    return NULL;
}

/* Blocks on the flock while a reclaim runs; finishes it if its owner died.
 * Returns -1 if the lock could not be had (a stopped reclaimer). */
static int wait_unfrozen(void) {
    if (lock_region() != 0)
        return -1;
    unlock_region();
    vc_region_reclaim();
    return 0;
}

int vc_reserve(int g, uint64_t size) {
    vc_region_gpu *gp = &R.gpu[g];
    uint64_t cap = R.cap[g];
    vc_region_slot *me = atomic_load_explicit(&R.me, memory_order_acquire);
    if (VC_UNLIKELY(!me) && !(me = claim_slot()))
        return -1;
    int reclaimed = 0;
    if (size > cap)
        goto oom;
again:
    atomic_fetch_add(&me->inflight, 1);
    uint64_t t = atomic_load(&gp->used);
    for (;;) {
        if (VC_UNLIKELY(t & VC_FROZEN)) {
            atomic_fetch_sub(&me->inflight, 1);
            if (wait_unfrozen() != 0)
                goto oom; /* fail closed rather than wait on a stopped process */
            goto again;
        }
        if (t > cap - size) {
            atomic_fetch_sub(&me->inflight, 1);
            /* Before saying no, look for processes that died holding memory. */
            if (!reclaimed) {
                reclaimed = 1;
                if (vc_region_reclaim() > 0)
                    goto again;
            }
            goto oom;
        }
        if (atomic_compare_exchange_weak(&gp->used, &t, t + size))
            break;
    }
    VC_TEST_PAUSE("reserve");
    atomic_fetch_add_explicit(&me->used[g], size, memory_order_relaxed);
    atomic_fetch_sub(&me->inflight, 1);
    return 0;
oom:
    atomic_fetch_add_explicit(&gp->oom_events, 1, memory_order_relaxed);
    return -1;
}

void vc_release(int g, uint64_t size) {
    vc_region_gpu *gp = &R.gpu[g];
    vc_region_slot *me = atomic_load_explicit(&R.me, memory_order_acquire);
    if (!me || size == 0)
        return; /* nothing was ever reserved by this process */
again:
    atomic_fetch_add(&me->inflight, 1);
    uint64_t t = atomic_load(&gp->used);
    for (;;) {
        if (VC_UNLIKELY(t & VC_FROZEN)) {
            atomic_fetch_sub(&me->inflight, 1);
            (void)wait_unfrozen(); /* a release must land: retry */
            goto again;
        }
        uint64_t nt = t >= size ? t - size : 0;
        if (atomic_compare_exchange_weak(&gp->used, &t, nt))
            break;
    }
    uint64_t mine = atomic_load_explicit(&me->used[g], memory_order_relaxed);
    while (!atomic_compare_exchange_weak(&me->used[g], &mine, mine >= size ? mine - size : 0))
        ;
    atomic_fetch_sub(&me->inflight, 1);
}

void vc_region_add_throttle(int g, uint64_t ns) {
    atomic_fetch_add_explicit(&R.gpu[g].throttled_ns, ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&R.gpu[g].throttle_events, 1, memory_order_relaxed);
}

int vc_region_procs(int g, uint32_t *pids, uint64_t *used, int max) {
    if (!R.base || g < 0 || g >= R.ngpus)
        return 0;
    int n = 0;
    for (int s = 0; s < VC_MAX_SLOTS; s++) {
        uint32_t pid = atomic_load(&R.slot[s].pid);
        uint64_t u = atomic_load(&R.slot[s].used[g]);
        /* Another container's process (a claim's shared region) is left out:
         * its pid means nothing, or another process, in this namespace. */
        if (pid == 0 || u == 0 || atomic_load(&R.slot[s].state) != VC_SLOT_LIVE || !slot_in_my_ns(s))
            continue;
        if (n < max) {
            pids[n] = pid;
            used[n] = u;
        }
        n++;
    }
    return n;
}

void vc_region_detach(void) {
    vc_region_slot *me = atomic_load(&R.me);
    if (!me)
        return;
    for (int g = 0; g < R.ngpus; g++) {
        uint64_t u = atomic_load(&me->used[g]);
        if (u)
            vc_release(g, u);
    }
    if (lock_region() != 0)
        return;
    if (atomic_load(&me->pid) == (uint32_t)R.pid) {
        clear_ctx(me);
        me->starttime = 0;
        me->pidns = 0;
        atomic_store(&me->state, VC_SLOT_FREE);
        atomic_store(&me->pid, 0);
        live_lock(R.fd, R.my_index, F_UNLCK, F_OFD_SETLK);
    }
    atomic_store(&R.me, NULL);
    unlock_region();
}

void vc_region_atfork_child(void) {
    /* The child holds no device memory (CUDA state does not survive fork) and
     * must not share the parent's slot or flock. */
    atomic_store(&R.me, NULL);
    R.my_index = -1;
    R.pid = getpid();
    R.pidns = pid_ns();
    char st;
    if (vc_proc_stat(R.pid, &st, &R.starttime) <= 0)
        R.starttime = 0;
    if (R.fd >= 0) {
        /* The inherited descriptor shares the parent's open file description,
         * and with it the parent's flock and liveness lock: were the child
         * to keep it, a dead parent would look alive. Replace it now. */
        int fd = open(R.path, O_RDWR | O_CLOEXEC);
        if (fd >= 0 && dup3(fd, R.fd, O_CLOEXEC) >= 0) {
            close(fd);
        } else {
            if (fd >= 0)
                close(fd);
            R.reopen = 1;
        }
    }
    pthread_mutex_init(&R_mu, NULL);
    pthread_mutex_init(&ctx_mu, NULL);
}
