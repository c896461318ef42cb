/* Walking a GGUF string array: the one loop of opening a model that costs CPython ~75 ns an
 * element (about 20 ms for a 150k-token vocabulary with its merges). Compiled when the
 * package is built, loaded with ctypes by gguf/native.py; the reader falls back to its own
 * loop when this library is absent. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WINDOW (1u << 20)

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
