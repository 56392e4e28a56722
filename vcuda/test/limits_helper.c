/*
 * limits_helper - runs the C limits-file parser on inputs sent over stdin,
 * for the Go fuzz target (FuzzLimitsParser): each input is a little-endian
 * u32 length and the bytes; each answer is one line:
 *   OK <container>\t<region>\t<uuid> <cap> <cores>\t...
 *   ERR <line>\t<message>
 * With the argument "measured", the node agent's measured compute file
 * instead, asked for pid 42, start 98765 on two GPUs (FuzzMeasuredParser):
 *   OK <written> <found> <busy> <at> <found> <busy> <at>
 *   ERR <message>
 * Built with AddressSanitizer/UBSan where available, so a memory error in
 * the parser kills the helper and fails the fuzz case.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/limits.h"

int main(int argc, char **argv) {
    static char buf[1 << 20];
    int measured = argc > 1 && strcmp(argv[1], "measured") == 0;
    static const char uuids[2][VC_UUID_LEN + 1] = {"GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b",
                                                   "GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7c"};
    for (;;) {
        unsigned char hdr[4];
        if (fread(hdr, 1, 4, stdin) != 4)
            return 0;
        uint32_t n = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 | (uint32_t)hdr[3] << 24;
        if (n > sizeof(buf) || fread(buf, 1, n, stdin) != n)
            return 1;
        /* exactly n bytes, no terminator: the parser must respect len */
        char *text = malloc(n ? n : 1);
        for (uint32_t i = 0; i < n; i++)
            text[i] = buf[i];
        if (measured) {
            uint64_t written = 0;
            vc_measured_line m[2];
            char err[512];
            if (vc_measured_parse(text, n, 42, 98765, uuids, 2, &written, m, err, sizeof(err)) == 0)
                printf("OK %llu %d %llu %llu %d %llu %llu\n", (unsigned long long)written, m[0].found,
                       (unsigned long long)m[0].busy, (unsigned long long)m[0].at, m[1].found,
                       (unsigned long long)m[1].busy, (unsigned long long)m[1].at);
            else
                printf("ERR %s\n", err);
            free(text);
            fflush(stdout);
            continue;
        }
        static vc_limits l;
        int line = -1;
        char err[512];
        if (vc_limits_parse(text, n, &l, &line, err, sizeof(err)) == 0) {
            printf("OK %s\t%s", l.container, l.region);
            for (int i = 0; i < l.ngpus; i++)
                printf("\t%s %llu %u", l.gpu[i].uuid, (unsigned long long)l.gpu[i].mem_cap, l.gpu[i].cores);
            printf("\n");
        } else {
            printf("ERR %d\t%s\n", line, err);
        }
        free(text);
        fflush(stdout);
    }
}
