/* Pure bf16's update on a CPU as one C loop (mpexp/precision/pure_native.py builds it).

   The same arithmetic as mpexp/precision/pure_kernels.py's `_update`, operation for operation and
   in the same order, so that this loop and torch.compile's of `_update` store the same bits
   (tests/test_pure_native.py compares them). What this loop does better on a CPU: it reads a
   float32 value's bits as an integer for nothing (inductor's C++ does so an element at a time),
   so stochastic rounding costs about as much as rounding to nearest, and a call costs a few
   microseconds, not tens.

   The variant is fixed when the file is compiled, by macros (a loop with no branch on what it
   computes is one the compiler vectorises):
     ADAM        1: Adam (states: first and second moment); 0: SGD (momentum buffer, if MOMENTUM)
     ROUNDING    0 nearest, 1 Kahan, 2 stochastic
     COUNT       0 none; 1 the two counts of each piece of the call (`ends`: where each
                 ends), which torch.compile's loop writes as masks to be summed afterwards
     DECOUPLED, MOMENTUM, NESTEROV, DECAY, SCALED, SIXTEEN (16-bit states, else float32)

   Built with -ffp-contract=off: a fused multiply-add would round otherwise than `_update` does,
   and Veltkamp's split (`nearest`) is exact only without one. */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>

#define STATES (ADAM ? 2 : MOMENTUM)

/* the elements from which a piece is stepped on several threads */
#define PARALLEL_FROM 65536

/* whether the loss scaler's overflow flag skips the step (never, unless SCALED) */
#define SKIPPED(k) (SCALED && (k).skip)

/* a state's new value stored as the variant rounds it (a skipped step leaves it as it was) */
#if SIXTEEN && ROUNDING == 2
#define STORE_STATE(p, i, value, noise) (p)[i] = SKIPPED(k) ? (p)[i] : stochastic(value, noise)
#elif SIXTEEN
#define STORE_STATE(p, i, value, noise) (p)[i] = to_bf16(SKIPPED(k) ? LOAD_STATE(p, i) : (value))
#else
#define STORE_STATE(p, i, value, noise) (p)[i] = SKIPPED(k) ? (p)[i] : (value)
#endif

#if SIXTEEN
typedef uint16_t state_t;
#define LOAD_STATE(p, i) from_bf16((p)[i])
#else
typedef float state_t;
#define LOAD_STATE(p, i) ((p)[i])
#endif

static inline float from_bf16(uint16_t h) {
  uint32_t b = (uint32_t)h << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

static inline uint32_t bits_of(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return b;
}

/* to bf16, to nearest with ties to even, as torch's conversion (a NaN stays a NaN) */
static inline uint16_t to_bf16(float x) {
  uint32_t b = bits_of(x);
  uint16_t rounded = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  return x != x ? (uint16_t)0x7FC0 : rounded;
}

/* up or down at random by distance: 16 random bits added to the pattern, the low 16 dropped */
static inline uint16_t stochastic(float x, uint32_t noise) {
  return (uint16_t)((bits_of(x) + noise) >> 16);
}

/* `_nearest`'s split: x to bf16's 8 significant bits, to nearest, kept in float32 */
static inline float nearest(float x) {
  float scaled = x * 0x1p-20f;
  float product = scaled * 65537.0f;
  return (product - (product - scaled)) * 0x1p20f;
}

/* `_noise`: the four-round Feistel network of the index's 16-bit halves, each XORed with a key */
static inline void feistel(uint64_t index, uint32_t k0, uint32_t k1, uint32_t *left,
                           uint32_t *right) {
  uint32_t l = (uint32_t)((index >> 16) & 0xFFFFu) ^ k0, r = (uint32_t)(index & 0xFFFFu) ^ k1;
  static const uint32_t multipliers[4] = {0x5BD1u, 0x6C8Bu, 0x4F1Du, 0x7A3Fu};
  for (int k = 0; k < 4; k++) {
    uint32_t mixed = r * multipliers[k];
    uint32_t next = l ^ ((mixed ^ (mixed >> 15)) & 0xFFFFu);
    l = r;
    r = next;
  }
  *left = l;
  *right = r;
}

/* One call's tensors, each over the call's elements. */
struct tensors {
  uint16_t *w;       /* the weights, bf16 */
  const uint16_t *g; /* their gradients, bf16 */
  state_t *s0, *s1;
  uint16_t *carried; /* Kahan's buffer, bf16 */
};

/* One call's constants. */
struct call {
  float c0, c1, c2, c3, c4, c5, c6; /* the step's coefficients (pure_kernels.py) */
  int lerp_from_end;                /* torch.lerp as torch decomposes it: from the nearer end */
  float lerp_coeff;
  float scale; /* the loss scale */
  int skip;    /* the loss scaler's overflow flag: the step changes nothing */
  uint32_t k0, k1, k2, k3; /* stochastic rounding's keys */
};

/* Element `i` stepped; returns whether its update was nonzero (bit 0) and whether its stored
   weight changed (bit 1), where the variant counts. */
static inline int element(uint16_t *restrict w, const uint16_t *restrict g, state_t *restrict s0,
                          state_t *restrict s1, uint16_t *restrict carried,
                          const struct call k, int64_t i) {
  const float wf = from_bf16(w[i]);
  float gf = from_bf16(g[i]);
#if SCALED
  gf = gf / k.scale;
#endif
  float value0 = 0.0f, value1 = 0.0f, updated;
#if ADAM
  const float m = LOAD_STATE(s0, i), s = LOAD_STATE(s1, i);
#if DECAY && !DECOUPLED
  gf = gf + k.c6 * wf;
#endif
  value0 = (k.lerp_from_end ? gf : m) + k.lerp_coeff * (gf - m);
  value1 = s * k.c1 + gf * gf * k.c2;
  const float denom = sqrtf(value1) / k.c3 + k.c4;
#if DECAY && DECOUPLED
  updated = wf * k.c6 - k.c5 * (value0 / denom);
#else
  updated = wf - k.c5 * (value0 / denom);
#endif
#else /* SGD */
#if DECAY
  gf = gf + k.c1 * wf;
#endif
#if MOMENTUM
  value0 = LOAD_STATE(s0, i) * k.c2 + gf * k.c3;
#if NESTEROV
  updated = wf - k.c0 * (gf + k.c4 * value0);
#else
  updated = wf - k.c0 * value0;
#endif
#else
  updated = wf - k.c0 * gf;
#endif
#endif
  const float new_weight = SKIPPED(k) ? wf : updated;
  (void)value0, (void)value1; /* (unused by some variants) */

#if ROUNDING == 2
  uint32_t noise0, noise1, noise2 = 0, unused;
  feistel((uint64_t)i, k.k0, k.k1, &noise0, &noise1);
#if SIXTEEN && STATES == 2
  feistel((uint64_t)i, k.k2, k.k3, &noise2, &unused);
#endif
  (void)noise1, (void)noise2, (void)unused;
#endif

  /* the states: a skipped step leaves them as they were */
#if STATES >= 1
  STORE_STATE(s0, i, value0, noise1);
#endif
#if STATES == 2
  STORE_STATE(s1, i, value1, noise2);
#endif

  /* the weight: what it keeps (`kept`, exact in bf16) and what is stored */
#if ROUNDING == 1
  const float before = from_bf16(carried[i]);
  const float wanted = (new_weight - wf) + before;
  float kept = nearest(wf + wanted);
  float remainder = wanted + (wf - kept);
  kept = SKIPPED(k) ? wf : kept;
  remainder = SKIPPED(k) ? before : remainder;
  carried[i] = to_bf16(remainder);
  const uint16_t rounded = to_bf16(kept);
#elif ROUNDING == 2
  const uint16_t rounded = stochastic(new_weight, noise0);
  const float kept = from_bf16(rounded);
  (void)kept;
#else
  const uint16_t rounded = to_bf16(new_weight);
#if COUNT
  const float kept = nearest(new_weight);
#endif
#endif

  w[i] = rounded;
#if COUNT
  const int moved = new_weight != wf;
#if ROUNDING == 0
  const int changed = moved && kept != wf;
#else
  const int changed = kept != wf;
#endif
  return moved | changed << 1;
#else
  return 0;
#endif
}

/* elements start:end on this thread: their (moved, changed) counts added to `counts` */
static void stretch(const struct tensors *t, const struct call *call, int64_t start, int64_t end,
                    int64_t *counts) {
  uint16_t *restrict w = t->w;
  const uint16_t *restrict g = t->g;
  state_t *restrict s0 = t->s0, *restrict s1 = t->s1;
  uint16_t *restrict carried = t->carried;
  const struct call k = *call;
  int64_t moved = 0, changed = 0;
#pragma omp simd reduction(+ : moved, changed)
  for (int64_t i = start; i < end; i++) {
    const int r = element(w, g, s0, s1, carried, k, i);
    moved += r & 1;
    changed += r >> 1;
  }
#pragma omp atomic
  counts[0] += moved;
#pragma omp atomic
  counts[1] += changed;
}

/* a piece's elements start:end, cut into one stretch a thread where it is long enough to pay */
static void piece(const struct tensors *t, const struct call *k, int64_t start, int64_t end,
                  int threads, int64_t *counts) {
  counts[0] = counts[1] = 0;
#ifdef _OPENMP
  if (threads > 1 && end - start >= PARALLEL_FROM) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t each = (end - start + omp_get_num_threads() - 1) / omp_get_num_threads();
      const int64_t from = start + each * omp_get_thread_num();
      stretch(t, k, from, from + each < end ? from + each : end, counts);
    }
    return;
  }
#endif
  (void)threads;
  stretch(t, k, start, end, counts);
}

/* One call: `w`, `g` bf16, `s0`, `s1` the states, `carried` Kahan's bf16 buffer, `c` the step's
   coefficients, `keys` stochastic rounding's four, `scaling` the loss scaler's scale and overflow
   flag; `pieces` pieces, one after another, ending at `ends`, whose (moved, changed) counts go to
   `counts` (2 a piece). */
void pure_update(uint16_t *w, const uint16_t *g, state_t *s0, state_t *s1, uint16_t *carried,
                 const float *c, const int32_t *keys, const float *scaling, int threads,
                 int64_t pieces, const int64_t *ends, int64_t *counts) {
  const struct tensors t = {w, g, s0, s1, carried};
  /* (Adam's seven coefficients, SGD's five) */
  struct call k = {c[0], c[1], c[2], c[3], c[4], ADAM ? c[5] : 0.0f, ADAM ? c[6] : 0.0f};
  k.lerp_from_end = fabsf(k.c0) >= 0.5f;
  k.lerp_coeff = k.lerp_from_end ? -(1.0f - k.c0) : k.c0;
  k.scale = scaling ? scaling[0] : 1.0f;
  k.skip = SCALED && scaling[1] != 0.0f;
  if (ROUNDING == 2) {
    k.k0 = (uint32_t)keys[0], k.k1 = (uint32_t)keys[1];
    k.k2 = (uint32_t)keys[2], k.k3 = (uint32_t)keys[3];
  }
  for (int64_t p = 0, start = 0; p < pieces; start = ends[p++])
    piece(&t, &k, start, ends[p], threads, counts + 2 * p);
}

/* A known answer, checked on each build before it is kept (mpexp/precision/pure_native.py): a
   compiler that reassociates float arithmetic, contracts it into fused multiply-adds or assumes
   no NaN (fast math) would break the split and the NaN test without a word. `one` is 1.0, handed
   in at run time so that nothing is folded when the file is compiled. 1 where all hold. */
int pure_probe(float one) {
  const float down = one + 0x1p-9f + 0x1p-20f; /* nearest bf16: 1 */
  const float up = one + 0x1p-8f + 0x1p-20f;   /* nearest bf16: 1 + 2^-7 */
  const float nan = (one - one) / (one - one);
  return nearest(down) == one && nearest(up) == one + 0x1p-7f && to_bf16(nan) == 0x7FC0 &&
         to_bf16(up) == 0x3F81;
}
