/*
 * limits_helper - runs the C limits-file parser on inputs sent over stdin,
 * for the Go fuzz target (FuzzLimitsParser): each input is a little-endian
 * u32 length and the bytes; each answer is one line:
 *   OK <container>\t<region>\t<uuid> <cap> <cores>\t...
 *   ERR <line>\t<message>
 * Built with AddressSanitizer/UBSan where available, so a memory error in
 * the parser kills the helper and fails the fuzz case.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../src/limits.h"

int main(void) {
    static char buf[1 << 20];
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
