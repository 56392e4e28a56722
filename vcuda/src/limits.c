/*
 * limits.c - strict parser for the limits file (contract with the node agent).
 * Anything that is not exactly to spec is rejected: the caller then fails
 * closed, because a half-understood limit is worse than none.
 */
#include "limits.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

#define MAX_FIELDS 8

static int is_uuid(const char *s) {
    /* GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx */
    static const int groups[5] = {8, 4, 4, 4, 12};
    if (strncmp(s, "GPU-", 4) != 0)
        return 0;
    s += 4;
    for (int g = 0; g < 5; g++) {
        for (int i = 0; i < groups[g]; i++, s++)
            if (!isxdigit((unsigned char)*s))
                return 0;
        if (g < 4 && *s++ != '-')
            return 0;
    }
    return *s == '\0';
}

/* Decimal without sign; 1..max. */
static int parse_u64(const char *s, uint64_t max, uint64_t *out) {
    uint64_t v = 0;
    if (*s == '\0')
        return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        unsigned d = (unsigned)(*s - '0');
        if (v > (max - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    if (v < 1)
        return -1;
    *out = v;
    return 0;
}

void vc_uuid_format(const unsigned char b[16], char out[VC_UUID_LEN + 1]) {
    snprintf(out, VC_UUID_LEN + 1,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
}

int vc_limits_find(const vc_limits *l, const char *uuid) {
    for (int i = 0; i < l->ngpus; i++)
        if (strcasecmp(l->gpu[i].uuid, uuid) == 0)
            return i;
    return -1;
}

/* Copies the line of text starting at *pos (up to '\n') into line as a C
 * string and moves *pos past it. Returns NULL, or what is wrong with it: too
 * long for cap, or a NUL, non-ASCII or control character (tab allowed where
 * tab_ok). */
static const char *next_line(const char *text, size_t len, size_t *pos, char *line, size_t cap, int tab_ok) {
    size_t end = *pos;
    while (end < len && text[end] != '\n')
        end++;
    size_t n = end - *pos;
    const char *src = text + *pos;
    *pos = end + 1;
    if (n >= cap)
        return "line too long";
    for (size_t i = 0; i < n; i++)
        if (src[i] == '\0' || (unsigned char)src[i] > 0x7e || ((unsigned char)src[i] < 0x20 && !(tab_ok && src[i] == '\t')))
            return "non-ASCII or control character";
    memcpy(line, src, n);
    line[n] = '\0';
    return NULL;
}

/* The node agent's files other than the limits file: the next line (as
 * next_line, no tab) split on single spaces into at most max fields.
 * Returns NULL, or what is wrong with it. */
static const char *next_fields(const char *text, size_t len, size_t *pos, char *line, size_t cap, char **f, int max,
                               int *nf) {
    const char *bad = next_line(text, len, pos, line, cap, 0);
    if (bad)
        return bad;
    char *p = line;
    for (*nf = 0;;) {
        if (*nf == max)
            return "extra field";
        f[(*nf)++] = p;
        while (*p && *p != ' ')
            p++;
        if (*p == '\0')
            break;
        *p++ = '\0';
    }
    for (int i = 0; i < *nf; i++)
        if (f[i][0] == '\0')
            return "empty field (fields are separated by one space)";
    return NULL;
}

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        *errline = lineno;                                                                         \
        snprintf(err, errlen, __VA_ARGS__);                                                        \
        return -1;                                                                                 \
    } while (0)

int vc_limits_parse(const char *text, size_t len, vc_limits *out, int *errline, char *err,
                    size_t errlen) {
    char line[8192];
    int lineno = 0, seen_header = 0, seen_container = 0, seen_region = 0;
    size_t pos = 0;

    memset(out, 0, sizeof(*out));
    while (pos < len) {
        lineno++;
        const char *bad = next_line(text, len, &pos, line, sizeof(line), 1);
        if (bad)
            FAIL("%s", bad);

        /* Blank (only separators) and comment lines are ignored. */
        size_t k = 0;
        while (line[k] == ' ' || line[k] == '\t')
            k++;
        if (line[k] == '\0' || line[0] == '#')
            continue;

        /* Split on single separators: an empty field (leading, trailing or
         * doubled separator) is an error rather than silently collapsed. */
        char *f[MAX_FIELDS + 1];
        int nf = 0;
        char *p = line;
        for (;;) {
            if (nf == MAX_FIELDS + 1)
                FAIL("extra field");
            f[nf++] = p;
            while (*p && *p != ' ' && *p != '\t')
                p++;
            if (*p == '\0')
                break;
            *p++ = '\0';
        }
        for (int i = 0; i < nf; i++)
            if (f[i][0] == '\0')
                FAIL("empty field (fields are separated by a single space or tab)");

        if (!seen_header) {
            if (nf != 2 || strcmp(f[0], "tessera-vcuda-limits") != 0)
                FAIL("expected header \"tessera-vcuda-limits 1\"");
            if (strcmp(f[1], "1") != 0)
                FAIL("unsupported version %s", f[1]);
            seen_header = 1;
            continue;
        }
        if (strcmp(f[0], "container") == 0) {
            if (nf < 2)
                FAIL("container: missing field");
            if (nf > 2)
                FAIL("container: extra field");
            if (seen_container)
                FAIL("container: given twice");
            if (strlen(f[1]) >= sizeof(out->container))
                FAIL("container: id too long");
            strcpy(out->container, f[1]);
            seen_container = 1;
        } else if (strcmp(f[0], "region") == 0) {
            if (nf < 2)
                FAIL("region: missing field");
            if (nf > 2)
                FAIL("region: extra field");
            if (seen_region)
                FAIL("region: given twice");
            if (f[1][0] != '/')
                FAIL("region: path must be absolute");
            if (strlen(f[1]) >= sizeof(out->region))
                FAIL("region: path too long");
            strcpy(out->region, f[1]);
            seen_region = 1;
        } else if (strcmp(f[0], "gpu") == 0) {
            uint64_t cap, cores;
            if (nf < 4)
                FAIL("gpu: missing field");
            if (nf > 4)
                FAIL("gpu: extra field");
            if (!is_uuid(f[1]))
                FAIL("gpu: bad uuid %s", f[1]);
            if (parse_u64(f[2], (uint64_t)INT64_MAX, &cap) != 0)
                FAIL("gpu: bad memory cap %s (want 1..%lld)", f[2], (long long)INT64_MAX);
            if (parse_u64(f[3], 100, &cores) != 0)
                FAIL("gpu: bad cores percent %s (want 1..100)", f[3]);
            if (out->ngpus == VC_MAX_GPUS)
                FAIL("gpu: more than %d gpu lines", VC_MAX_GPUS);
            if (vc_limits_find(out, f[1]) >= 0)
                FAIL("gpu: duplicated uuid %s", f[1]);
            vc_gpu_limit *g = &out->gpu[out->ngpus++];
            /* Canonical form, as NVML prints it: "GPU-" and lower-case hex. */
            memcpy(g->uuid, "GPU-", 4);
            for (int i = 4; f[1][i]; i++)
                g->uuid[i] = (char)tolower((unsigned char)f[1][i]);
            g->mem_cap = cap;
            g->cores = (uint32_t)cores;
        } else {
            FAIL("unknown keyword %s", f[0]);
        }
    }
    if (!seen_header)
        FAIL("missing header \"tessera-vcuda-limits 1\"");
    if (!seen_container)
        FAIL("missing container line");
    if (!seen_region)
        FAIL("missing region line");
    if (out->ngpus == 0)
        FAIL("no gpu line");
    return 0;
}

/* The node agent's context overhead file. Strict like the limits file: any
 * line not exactly to spec makes the whole file unusable. */
int vc_overhead_parse(const char *text, size_t len, const char *uuid, uint64_t now, uint64_t *bytes,
                      char *err, size_t errlen) {
    char line[256];
    int lineno = 0, seen_written = 0;
    uint64_t found = 0;
    size_t pos = 0;
#undef FAIL
#define FAIL(...)                                                                                  \
    do {                                                                                           \
        int n_ = snprintf(err, errlen, "line %d: ", lineno);                                      \
        if (n_ > 0 && (size_t)n_ < errlen)                                                         \
            snprintf(err + n_, errlen - (size_t)n_, __VA_ARGS__);                                  \
        return -1;                                                                                 \
    } while (0)
    *bytes = 0;
    while (pos < len) {
        lineno++;
        char *f[4];
        int nf;
        const char *bad = next_fields(text, len, &pos, line, sizeof(line), f, 4, &nf);
        if (bad)
            FAIL("%s", bad);
        if (lineno == 1) {
            if (nf != 2 || strcmp(f[0], "tessera-context-overhead") != 0 || strcmp(f[1], "1") != 0)
                FAIL("expected header \"tessera-context-overhead 1\"");
            continue;
        }
        uint64_t v;
        if (strcmp(f[0], "written") == 0) {
            if (nf != 2 || seen_written || parse_u64(f[1], UINT64_MAX, &v) != 0)
                FAIL("written: one time in seconds");
            /* Too old: the agent stopped measuring; from the future: not a
             * time this agent wrote (a minute of slack for clock steps). */
            if (v + VC_OVERHEAD_MAX_AGE < now || v > now + 60)
                FAIL("written %llu is not within %d s before now (%llu)", (unsigned long long)v,
                     VC_OVERHEAD_MAX_AGE, (unsigned long long)now);
            seen_written = 1;
        } else if (strcmp(f[0], "gpu") == 0) {
            if (nf != 3 || !is_uuid(f[1]) || parse_u64(f[2], VC_OVERHEAD_MAX_BYTES, &v) != 0)
                FAIL("gpu: a UUID and a byte count up to %llu", (unsigned long long)VC_OVERHEAD_MAX_BYTES);
            if (strcasecmp(f[1], uuid) == 0)
                found = v;
        } else {
            FAIL("unknown keyword %s", f[0]);
        }
    }
    if (lineno == 0)
        FAIL("empty");
    if (!seen_written)
        FAIL("no written line");
    *bytes = found;
    return 0;
}

/* A number of the measured file: decimal, no sign, no leading zero (but
 * "0"), at most UINT64_MAX. */
static int parse_u64_strict(const char *s, uint64_t *out) {
    if (s[0] == '0' && s[1] != '\0')
        return -1;
    if (s[0] == '0') {
        *out = 0;
        return 0;
    }
    return parse_u64(s, UINT64_MAX, out);
}

static int is_canonical_uuid(const char *s) {
    if (!is_uuid(s))
        return 0;
    for (s += 4; *s; s++)
        if (*s >= 'A' && *s <= 'F')
            return 0;
    return 1;
}

/* The node agent's measured compute file. Strict: the file is the closed
 * loop's reference, so anything off spec makes all of it unusable rather
 * than half read. */
static int measured_parse(const char *text, size_t len, uint64_t pid, uint64_t start, const char (*uuids)[VC_UUID_LEN + 1],
                          int n, uint64_t *written, vc_measured_line *out, char *err, size_t errlen) {
    char line[256];
    int lineno = 0, gpus = 0;
    size_t pos = 0;
    for (int i = 0; i < n; i++)
        out[i] = (vc_measured_line){0, 0, 0};
    *written = 0;
    if (len > VC_MEASURED_MAX_BYTES)
        FAIL("file larger than %u bytes", VC_MEASURED_MAX_BYTES);
    if (len > 0 && text[len - 1] != '\n') {
        for (size_t i = 0; i < len; i++)
            lineno += text[i] == '\n';
        lineno++;
        FAIL("no newline at the end");
    }
    while (pos < len) {
        lineno++;
        char *f[10];
        int nf;
        const char *bad = next_fields(text, len, &pos, line, sizeof(line), f, 10, &nf);
        if (bad)
            FAIL("%s", bad);
        if (lineno == 1) {
            if (nf != 2 || strcmp(f[0], "tessera-compute-measured") != 0 || strcmp(f[1], "1") != 0)
                FAIL("expected header \"tessera-compute-measured 1\"");
            continue;
        }
        if (lineno == 2) {
            if (nf != 2 || strcmp(f[0], "written") != 0 || parse_u64_strict(f[1], written) != 0)
                FAIL("expected \"written <ns>\"");
            continue;
        }
        uint64_t lp, ls, lb, la;
        if (nf != 10 || strcmp(f[0], "gpu") != 0 || strcmp(f[2], "pid") != 0 || strcmp(f[4], "start") != 0 ||
            strcmp(f[6], "busy") != 0 || strcmp(f[8], "at") != 0)
            FAIL("expected \"gpu <uuid> pid <n> start <n> busy <ns> at <ns>\"");
        if (!is_canonical_uuid(f[1]))
            FAIL("gpu: bad uuid %s (GPU- and lower-case hex)", f[1]);
        if (parse_u64_strict(f[3], &lp) != 0 || parse_u64_strict(f[5], &ls) != 0 ||
            parse_u64_strict(f[7], &lb) != 0 || parse_u64_strict(f[9], &la) != 0)
            FAIL("gpu: numbers are decimal without sign or leading zeros");
        if (++gpus > VC_MEASURED_MAX_LINES)
            FAIL("more than %d gpu lines", VC_MEASURED_MAX_LINES);
#ifdef VC_MUTATE_MEASURED_PID_ONLY
        ls = start;
#endif
        if (lp != pid || ls != start)
            continue;
        for (int i = 0; i < n; i++) {
            if (strcmp(uuids[i], f[1]) != 0)
                continue;
            if (out[i].found)
                FAIL("gpu %s pid %llu start %llu given twice", f[1], (unsigned long long)lp,
                     (unsigned long long)ls);
            out[i] = (vc_measured_line){1, lb, la};
        }
    }
    if (lineno < 2)
        FAIL("expected header and \"written <ns>\"");
    return 0;
}
#undef FAIL

int vc_measured_parse(const char *text, size_t len, uint64_t pid, uint64_t start, const char (*uuids)[VC_UUID_LEN + 1],
                      int n, uint64_t *written, vc_measured_line *out, char *err, size_t errlen) {
    if (measured_parse(text, len, pid, start, uuids, n, written, out, err, errlen) == 0)
        return 0;
    for (int i = 0; i < n; i++) /* nothing of a file off spec is used */
        out[i].found = 0;
    return -1;
}
