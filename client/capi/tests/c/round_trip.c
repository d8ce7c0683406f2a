/* The C ABI end to end, against the store at argv[1]: keys from tokens,
 * a batch put and get_into verified byte for byte, a miss, prefix match,
 * overlapping buffers refused, removal, and a failed connect. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mooncake.h"

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s:%d: %s failed (%s)\n", __FILE__, __LINE__, \
                    #cond, mc_last_error());                                \
            return 1;                                                       \
        }                                                                   \
    } while (0)

enum { N = 16, BLOCK = 64 * 1024 };

static void hex(const uint8_t *h, char *out) {
    for (int i = 0; i < 32; i++) sprintf(out + 2 * i, "%02x", h[i]);
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    McClient *bad = mc_connect("127.0.0.1:1", "c/test", NULL, 500);
    CHECK(bad == NULL && strlen(mc_last_error()) > 0);

    McClient *c = mc_connect(argv[1], "c/test", NULL, 5000);
    CHECK(c != NULL);

    /* The documented test vectors (docs/block-keys.md). */
    uint32_t tokens[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    uint8_t chain[2 * 32];
    char h[65];
    CHECK(mc_block_hashes(tokens, 8, 4, NULL, 0, chain, 2) == 2);
    hex(chain + 32, h);
    CHECK(strcmp(h, "01f8357aa6686646a99da02ac8c1c213946adbc69efcf6d9d796f0fb9a96dd01") == 0);
    uint8_t opaque[32];
    CHECK(mc_opaque_hash("vllm-block-42", opaque) == MC_OK);
    hex(opaque, h);
    CHECK(strcmp(h, "afa690cd3257f3991b5b85a995552f0fed3b013c8877209c32ccccf2b2c8b5d6") == 0);

    /* A chain of N keys, stored in one batch. */
    uint32_t many[N * 4];
    for (int i = 0; i < N * 4; i++) many[i] = 1000 + i;
    uint8_t keys[(N + 1) * 32];
    CHECK(mc_block_hashes(many, N * 4, 4, (const uint8_t *)"seed", 4, keys, N) == N);
    uint8_t *values[N];
    size_t lens[N];
    int64_t results[N + 1];
    for (int i = 0; i < N; i++) {
        values[i] = malloc(BLOCK);
        lens[i] = BLOCK - i;
        for (int j = 0; j < BLOCK; j++) values[i][j] = (uint8_t)(i * 31 + j / 7);
    }
    CHECK(mc_put(c, keys, (const uint8_t *const *)values, lens, N, results) == MC_OK);
    for (int i = 0; i < N; i++) CHECK(results[i] == MC_OK);
    CHECK(mc_match_prefix(c, keys, N) == N);

    /* Read them back into one arena, plus a key never stored. */
    uint8_t *arena = calloc(N + 1, BLOCK);
    uint8_t *bufs[N + 1];
    size_t caps[N + 1];
    for (int i = 0; i <= N; i++) {
        bufs[i] = arena + (size_t)i * BLOCK;
        caps[i] = BLOCK;
    }
    CHECK(mc_opaque_hash("never stored", keys + N * 32) == MC_OK);
    CHECK(mc_get_into(c, keys, bufs, caps, N + 1, results) == MC_OK);
    for (int i = 0; i < N; i++) {
        CHECK(results[i] == (int64_t)lens[i]);
        CHECK(memcmp(bufs[i], values[i], lens[i]) == 0);
    }
    CHECK(results[N] == MC_OBJECT_NOT_FOUND);

    /* Two destinations that overlap are refused; nothing is written. */
    memset(arena, 0, 2 * BLOCK);
    uint8_t *overlap[2] = {arena, arena + 100};
    CHECK(mc_get_into(c, keys, overlap, caps, 2, results) == MC_OK);
    CHECK(results[0] == MC_INVALID_PARAMS && results[1] == MC_INVALID_PARAMS);
    CHECK(arena[0] == 0 && arena[100] == 0);

    /* A buffer smaller than its block. */
    size_t small = 10;
    CHECK(mc_get_into(c, keys, bufs, &small, 1, results) == MC_OK);
    CHECK(results[0] == MC_INVALID_PARAMS);

    CHECK(mc_remove(c, keys, 2, results) == MC_OK);
    CHECK(results[0] == MC_OK && results[1] == MC_OK);
    CHECK(mc_remove(c, keys, 1, results) == MC_OK && results[0] == MC_OBJECT_NOT_FOUND);
    CHECK(mc_match_prefix(c, keys, N) == 0);
    CHECK(mc_put(NULL, keys, NULL, NULL, 1, results) == MC_INVALID_PARAMS);

    mc_close(c);
    for (int i = 0; i < N; i++) free(values[i]);
    free(arena);
    puts("ok");
    return 0;
}
