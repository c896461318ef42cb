/* Compiled helpers for the two host-side loops of opening a model that CPython runs at
 * ~75-700 ns an element: walking a GGUF string array (150k tokens + 150k merges) and packing
 * one into the tokenizer's string table. pip builds this file with the package; native.py
 * loads it with ctypes, and every caller keeps a Python path for installs without it. */
#define _POSIX_C_SOURCE 200809L /* sigaction, pread under a strict -std */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WINDOW ((size_t)1 << 20)

/* Skips `count` strings (u64 little-endian length, then that many bytes) of file `fd` from
 * `offset`, never reading past `size`. Returns the offset just past the last string;
 * -(i + 1) when string i's length field or bytes run past `size`; INT64_MIN on a read error. */
int64_t reflex_skip_strings(int fd, uint64_t offset, uint64_t count, uint64_t size) {
    unsigned char *window = malloc(WINDOW);
    uint64_t start = 0, end = 0; /* file range held in window */
    int64_t result = INT64_MIN;
    if (window == NULL)
        return INT64_MIN;
    for (uint64_t i = 0; i < count; i++) {
        if (offset > size || size - offset < 8) {
            result = -(int64_t)(i + 1);
            goto done;
        }
        if (offset < start || offset + 8 > end) {
            size_t want = size - offset < WINDOW ? (size_t)(size - offset) : WINDOW;
            size_t got = 0;
            while (got < want && want <= WINDOW) {
                ssize_t n = pread(fd, window + got, want - got, (off_t)(offset + got));
                if (n < 0 && errno == EINTR)
                    continue;
                if (n <= 0)
                    goto done;
                got += (size_t)n;
            }
            start = offset;
            end = offset + got;
        }
        uint64_t length;
        memcpy(&length, window + (offset - start), 8);
        if (length > size - offset - 8) {
            result = -(int64_t)(i + 1);
            goto done;
        }
        offset += 8 + length;
    }
    result = (int64_t)offset;
done:
    free(window);
    return result;
}

/* zlib's crc32 (reflected polynomial 0xEDB88320), so tables match strings.py's zlib.crc32. */
static uint32_t crc32_of(const uint32_t *table, const uint8_t *p, uint64_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n--)
        c = table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* Packs `count` GGUF strings held in `region` into `blob` (their bytes back to back) and
 * `offsets` (count + 1 entries) and indexes them in `slots` (`n_slots`, a power of two, all
 * -1 on entry): crc32 home slot, linear probing, a repeated string counted and not indexed --
 * exactly tokenizer/strings.py's Strings.build. status[0] = the longest probe run, [1] = the
 * number of repeats, [2] = the first empty string or -1, [3] = with `check_pairs`, the first
 * string with no space after its first byte or a space only as its last byte, else -1.
 * Returns 0, or -1 when the region does not hold `count` strings that fill the blob. */
int reflex_pack_strings(const uint8_t *region, uint64_t region_len, uint64_t count, int check_pairs,
                        uint8_t *blob, uint64_t blob_len, uint32_t *offsets, int32_t *slots,
                        uint64_t n_slots, int64_t *status) {
    uint32_t table[256];
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[b] = c;
    }
    uint64_t at = 0, filled = 0, mask = n_slots - 1;
    int64_t longest = 1, repeats = 0, first_empty = -1, first_bad_pair = -1;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t length;
        if (region_len - at < 8)
            return -1;
        memcpy(&length, region + at, 8);
        at += 8;
        if (length > region_len - at || length > blob_len - filled || length > UINT32_MAX ||
            filled > UINT32_MAX - length)
            return -1;
        const uint8_t *key = region + at;
        if (length > 0) /* blob may be NULL when every string is empty */
            memcpy(blob + filled, key, length);
        offsets[i] = (uint32_t)filled;
        filled += length;
        at += length;
        if (length == 0 && first_empty < 0)
            first_empty = (int64_t)i;
        if (check_pairs && first_bad_pair < 0) {
            const uint8_t *cut = length > 1 ? memchr(key + 1, ' ', length - 1) : NULL;
            if (cut == NULL || cut == key + length - 1)
                first_bad_pair = (int64_t)i;
        }
        uint64_t s = crc32_of(table, key, length) & mask;
        int64_t probe = 1, repeated = 0;
        while (slots[s] >= 0) {
            uint32_t j = (uint32_t)slots[s];
            if (offsets[j + 1] - offsets[j] == length && (length == 0 || memcmp(blob + offsets[j], key, length) == 0)) {
                repeated = 1;
                break;
            }
            s = (s + 1) & mask;
            probe++;
        }
        if (repeated) {
            repeats++;
        } else {
            slots[s] = (int32_t)i;
            if (probe > longest)
                longest = probe;
        }
        offsets[i + 1] = (uint32_t)filled;
    }
    if (at != region_len || filled != blob_len)
        return -1;
    status[0] = longest;
    status[1] = repeats;
    status[2] = first_empty;
    status[3] = first_bad_pair;
    return 0;
}

/* A mapped file that shrinks under the process (truncated, or rewritten in place) turns the
 * next read of a vanished page into SIGBUS, which Python cannot catch: its handler returns and
 * the read faults again. This handler writes `message` (one line) to stderr and exits with
 * `code`, async-signal-safe. Returns sigaction's result. */
static char bus_message[512];
static size_t bus_length;
static int bus_code;

static void on_bus(int sig) {
    (void)sig;
    ssize_t n = write(2, bus_message, bus_length);
    (void)n;
    _exit(bus_code);
}

int reflex_exit_on_sigbus(const char *message, int code) {
    size_t n = strlen(message);
    if (n >= sizeof bus_message)
        n = sizeof bus_message - 1;
    memcpy(bus_message, message, n);
    bus_length = n;
    bus_code = code;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_bus;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGBUS, &action, NULL);
}
