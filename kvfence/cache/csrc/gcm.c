/* AES-256-GCM (96-bit nonce, 128-bit tag, NIST SP 800-38D) on VAES and VPCLMULQDQ: the KV seals' cipher,
 * called through ctypes, which releases the GIL for the call.
 *
 * Built only for CPUs that report AVX-512 (F, BW), VAES, VPCLMULQDQ, AES and PCLMULQDQ (gcm.py checks;
 * never -march=native). Thirty-two blocks a step: the counter blocks encrypted four to a register, their
 * GHASH summed unreduced against H^32..H^1 and reduced once. Everything is computed per call from the
 * key (no state, any thread); the round keys and powers of H laid out in memory are overwritten before the
 * call returns (what the compiler keeps in registers or spills is not).
 *
 * GHASH works on byte-reversed blocks (Gueron and Kounavis, "Intel Carry-Less Multiplication Instruction
 * and its Usage for Computing the GCM Mode", algorithms 2 and 4): `reduce` is their shift and reduction
 * of a 256-bit carry-less product given as low, middle (both cross terms) and high halves.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ROUNDS 14
#define LANES 8 /* registers of four blocks a step */
#define STEP (LANES * 4) /* blocks a step */

typedef struct {
    __m128i rk[ROUNDS + 1];
    __m128i h;          /* H, byte-reversed */
    __m128i pow[STEP];  /* pow[j] = H^(STEP - j), byte-reversed: block j of a step */
} gcm_key;

static inline __m128i reverse(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

static inline __m128i reduce(__m128i lo, __m128i mid, __m128i hi) {
    lo = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
    hi = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
    /* the product shifted left one bit (the reflected representation's off-by-one) */
    __m128i lo_carry = _mm_srli_epi32(lo, 31), hi_carry = _mm_srli_epi32(hi, 31);
    lo = _mm_slli_epi32(lo, 1);
    hi = _mm_slli_epi32(hi, 1);
    __m128i cross = _mm_srli_si128(lo_carry, 12);
    hi = _mm_or_si128(_mm_or_si128(hi, _mm_slli_si128(hi_carry, 4)), cross);
    lo = _mm_or_si128(lo, _mm_slli_si128(lo_carry, 4));
    /* reduction modulo x^128 + x^7 + x^2 + x + 1 */
    __m128i a = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(lo, 31), _mm_slli_epi32(lo, 30)),
                              _mm_slli_epi32(lo, 25));
    __m128i b = _mm_srli_si128(a, 4);
    lo = _mm_xor_si128(lo, _mm_slli_si128(a, 12));
    __m128i c = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(lo, 1), _mm_srli_epi32(lo, 2)), _mm_srli_epi32(lo, 7));
    c = _mm_xor_si128(c, b);
    lo = _mm_xor_si128(lo, c);
    return _mm_xor_si128(hi, lo);
}

static inline __m128i gfmul(__m128i a, __m128i b) {
    __m128i mid = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10), _mm_clmulepi64_si128(a, b, 0x01));
    return reduce(_mm_clmulepi64_si128(a, b, 0x00), mid, _mm_clmulepi64_si128(a, b, 0x11));
}

#define EXPAND_ROT(i, rcon)                                                        \
    do {                                                                           \
        __m128i t = _mm_shuffle_epi32(_mm_aeskeygenassist_si128(k->rk[i - 1], rcon), 0xff); \
        __m128i p = k->rk[i - 2];                                                  \
        p = _mm_xor_si128(p, _mm_slli_si128(p, 4));                                \
        p = _mm_xor_si128(p, _mm_slli_si128(p, 8));                                \
        k->rk[i] = _mm_xor_si128(p, t);                                            \
    } while (0)
#define EXPAND_SUB(i)                                                             \
    do {                                                                           \
        __m128i t = _mm_shuffle_epi32(_mm_aeskeygenassist_si128(k->rk[i - 1], 0), 0xaa); \
        __m128i p = k->rk[i - 2];                                                  \
        p = _mm_xor_si128(p, _mm_slli_si128(p, 4));                                \
        p = _mm_xor_si128(p, _mm_slli_si128(p, 8));                                \
        k->rk[i] = _mm_xor_si128(p, t);                                            \
    } while (0)

static void wipe(void *p, size_t n) {
    memset(p, 0, n);
    __asm__ __volatile__("" : : "r"(p) : "memory"); /* the stores are not dead: something may read them */
}

static inline __m128i encrypt_block(const gcm_key *k, __m128i x) {
    x = _mm_xor_si128(x, k->rk[0]);
    for (int r = 1; r < ROUNDS; r++) x = _mm_aesenc_si128(x, k->rk[r]);
    return _mm_aesenclast_si128(x, k->rk[ROUNDS]);
}

static void setup(gcm_key *k, const uint8_t *key) {
    k->rk[0] = _mm_loadu_si128((const __m128i *)key);
    k->rk[1] = _mm_loadu_si128((const __m128i *)(key + 16));
    EXPAND_ROT(2, 0x01); EXPAND_SUB(3);
    EXPAND_ROT(4, 0x02); EXPAND_SUB(5);
    EXPAND_ROT(6, 0x04); EXPAND_SUB(7);
    EXPAND_ROT(8, 0x08); EXPAND_SUB(9);
    EXPAND_ROT(10, 0x10); EXPAND_SUB(11);
    EXPAND_ROT(12, 0x20); EXPAND_SUB(13);
    EXPAND_ROT(14, 0x40);
    k->h = reverse(encrypt_block(k, _mm_setzero_si128()));
    __m128i power = k->h;
    for (int j = STEP - 1; j >= 0; j--) {
        k->pow[j] = power;
        power = gfmul(power, k->h);
    }
}

/* GHASH of `n` bytes, zero-padded to whole blocks, folded into `y` block by block. */
static __m128i ghash_bytes(const gcm_key *k, __m128i y, const uint8_t *p, size_t n) {
    for (; n >= 16; p += 16, n -= 16) y = gfmul(_mm_xor_si128(y, reverse(_mm_loadu_si128((const __m128i *)p))), k->h);
    if (n) {
        uint8_t last[16] = {0};
        memcpy(last, p, n);
        y = gfmul(_mm_xor_si128(y, reverse(_mm_loadu_si128((const __m128i *)last))), k->h);
    }
    return y;
}

static inline __m128i sum_lanes(__m512i z) {
    __m128i s = _mm_xor_si128(_mm512_extracti32x4_epi32(z, 0), _mm512_extracti32x4_epi32(z, 1));
    return _mm_xor_si128(s, _mm_xor_si128(_mm512_extracti32x4_epi32(z, 2), _mm512_extracti32x4_epi32(z, 3)));
}

/* Four blocks' carry-less products with their powers of H, added (unreduced) to the halves. */
static inline void multiply_into(__m512i c, __m512i h, __m512i *lo, __m512i *mid, __m512i *hi) {
    *lo = _mm512_xor_si512(*lo, _mm512_clmulepi64_epi128(c, h, 0x00));
    *hi = _mm512_xor_si512(*hi, _mm512_clmulepi64_epi128(c, h, 0x11));
    *mid = _mm512_xor_si512(*mid, _mm512_clmulepi64_epi128(c, h, 0x01));
    *mid = _mm512_xor_si512(*mid, _mm512_clmulepi64_epi128(c, h, 0x10));
}

/* Counter mode over `len` bytes from `in` to `out`, GHASH over the ciphertext (what `out` gets when
 * sealing, what `in` holds when opening) folded into `y`, which is returned. */
static __m128i ctr_ghash(const gcm_key *k, __m128i j0_reversed, const uint8_t *in, uint8_t *out, size_t len,
                         int sealing, __m128i y) {
    const __m512i swap = _mm512_broadcast_i32x4(
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i rk[ROUNDS + 1], pow[LANES];
    for (int r = 0; r <= ROUNDS; r++) rk[r] = _mm512_broadcast_i32x4(k->rk[r]);
    for (int q = 0; q < LANES; q++) pow[q] = _mm512_loadu_si512((const void *)&k->pow[4 * q]);
    /* reversed, the 32-bit big-endian counter is the low little-endian dword: add wraps it as inc32 does */
    __m512i ctr = _mm512_add_epi32(_mm512_broadcast_i32x4(j0_reversed),
                                   _mm512_set_epi32(0, 0, 0, 4, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 1));
    const __m512i four = _mm512_set_epi32(0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4);
    size_t done = 0;
    /* Software-pipelined: a step's AES rounds run beside the GHASH of the step before (`c`, its reversed
     * ciphertext), one register's products a round, so the AES and carry-less multiply units work together. */
    __m512i c[LANES];
    int pending = 0;
    for (; len - done >= STEP * 16; done += STEP * 16) {
        __m512i x[LANES];
        for (int q = 0; q < LANES; q++) {
            x[q] = _mm512_xor_si512(_mm512_shuffle_epi8(ctr, swap), rk[0]);
            ctr = _mm512_add_epi32(ctr, four);
        }
        __m512i lo = _mm512_setzero_si512(), mid = lo, hi = lo;
        if (pending) c[0] = _mm512_xor_si512(c[0], _mm512_inserti32x4(_mm512_setzero_si512(), y, 0));
        for (int r = 1; r < ROUNDS; r++) {
            for (int q = 0; q < LANES; q++) x[q] = _mm512_aesenc_epi128(x[q], rk[r]);
            if (pending && r <= LANES) {
                multiply_into(c[r - 1], pow[r - 1], &lo, &mid, &hi);
            }
        }
        if (pending) y = reduce(sum_lanes(lo), sum_lanes(mid), sum_lanes(hi));
        for (int q = 0; q < LANES; q++) {
            __m512i data = _mm512_loadu_si512((const void *)(in + done + 64 * q));
            __m512i result = _mm512_xor_si512(_mm512_aesenclast_epi128(x[q], rk[ROUNDS]), data);
            _mm512_storeu_si512((void *)(out + done + 64 * q), result);
            c[q] = _mm512_shuffle_epi8(sealing ? result : data, swap);
        }
        pending = 1;
    }
    if (pending) {
        c[0] = _mm512_xor_si512(c[0], _mm512_inserti32x4(_mm512_setzero_si512(), y, 0));
        __m512i lo = _mm512_setzero_si512(), mid = lo, hi = lo;
        for (int q = 0; q < LANES; q++) multiply_into(c[q], pow[q], &lo, &mid, &hi);
        y = reduce(sum_lanes(lo), sum_lanes(mid), sum_lanes(hi));
    }
    /* the rest, a block at a time; its counter continues from the wide loop's */
    __m128i next = _mm_add_epi32(j0_reversed, _mm_set_epi32(0, 0, 0, (int)(done / 16 + 1)));
    for (; done < len; done += 16) {
        size_t n = len - done < 16 ? len - done : 16;
        uint8_t block[16] = {0}, result[16];
        memcpy(block, in + done, n);
        __m128i stream = encrypt_block(k, reverse(next));
        next = _mm_add_epi32(next, _mm_set_epi32(0, 0, 0, 1));
        _mm_storeu_si128((__m128i *)result, _mm_xor_si128(stream, _mm_loadu_si128((const __m128i *)block)));
        memcpy(out + done, result, n);
        memset(result + n, 0, 16 - n);
        y = ghash_bytes(k, y, sealing ? result : block, 16);
    }
    wipe(rk, sizeof rk);
    wipe(pow, sizeof pow);
    return y;
}

/* The tag of a message whose counter mode pass left GHASH at `y`. */
static __m128i finish(const gcm_key *k, __m128i j0_reversed, __m128i y, size_t aad_len, size_t len) {
    __m128i lengths = _mm_set_epi64x((long long)(aad_len * 8), (long long)(len * 8)); /* reversed already */
    y = gfmul(_mm_xor_si128(y, lengths), k->h);
    return _mm_xor_si128(reverse(y), encrypt_block(k, reverse(j0_reversed)));
}

static __m128i j0_of(const uint8_t *nonce) {
    uint8_t j0[16] = {0};
    memcpy(j0, nonce, 12);
    j0[15] = 1;
    return reverse(_mm_loadu_si128((const __m128i *)j0));
}

/* Seal `len` bytes of `in` into `out` (may be `in`), the tag into `tag`. */
void kv_gcm_seal(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, size_t aad_len,
                 const uint8_t *in, size_t len, uint8_t *out, uint8_t *tag) {
    gcm_key k;
    setup(&k, key);
    __m128i j0 = j0_of(nonce);
    __m128i y = ctr_ghash(&k, j0, in, out, len, 1, ghash_bytes(&k, _mm_setzero_si128(), aad, aad_len));
    _mm_storeu_si128((__m128i *)tag, finish(&k, j0, y, aad_len, len));
    wipe(&k, sizeof k);
}

/* Open `len` bytes of `in` into `out`: 1 when `tag` verifies (compared in constant time), else 0, and
 * `out` then holds bytes that must not be used. */
int kv_gcm_open(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, size_t aad_len,
                const uint8_t *in, size_t len, const uint8_t *tag, uint8_t *out) {
    gcm_key k;
    setup(&k, key);
    __m128i j0 = j0_of(nonce);
    __m128i y = ctr_ghash(&k, j0, in, out, len, 0, ghash_bytes(&k, _mm_setzero_si128(), aad, aad_len));
    __m128i diff = _mm_xor_si128(finish(&k, j0, y, aad_len, len), _mm_loadu_si128((const __m128i *)tag));
    wipe(&k, sizeof k);
    return _mm_testz_si128(diff, diff);
}
