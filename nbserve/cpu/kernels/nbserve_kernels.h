/* nbserve's C kernel interface, written once: the weight kinds, the matmul flags, the structs
 * and the prototypes of every function the library exports. Every .c file includes it, so the
 * compiler checks each definition against its prototype here; the Python side
 * (nbserve/cpu/kernels/abi.py) reads this file to declare the ctypes argument types, the
 * structs and the kind and flag values, so nothing of it is written a second time.
 *
 * abi.py parses a small subset of C, so keep to it: named enums with explicit values,
 * `typedef struct { ... } name;` (or `typedef struct name { ... } name;`, whose fields may
 * point to `struct name`) with fields of the types below (several names a line are
 * fine), and prototypes `int nbq_name(type name, ...);` on one or more lines. Types: int,
 * int32_t, float, double, void, and pointers to anything (passed as addresses).
 */
#ifndef NBSERVE_KERNELS_H
#define NBSERVE_KERNELS_H

#include <stdint.h>

typedef uint16_t half_t; /* an IEEE float16: the quantized blocks' scales and minimums */

/* A weight's storage (nbq_weight.kind; the matmul entry point of each). */
enum nbq_kind {
    NBQ_Q4 = 0,  /* 4-bit codes with a float16 scale and minimum per block of 32 */
    NBQ_Q8 = 1,  /* signed 8-bit codes with a float16 scale per block of 32 */
    NBQ_F32 = 2, /* float32 rows as they are */
    NBQ_BLOCKS = 3, /* GGUF blocks as the file stores them, of ggml type block_type (codes) */
    NBQ_PARTS = 4,  /* consecutive parts, each an nbq_weight of another kind (part, parts) */
};

/* The GGUF block types of gguf_blocks.c, numbered as ggml's enum ggml_type (the `gguf` package's
 * GGMLQuantizationType); nbq_blocks_supported says which a build serves. */
enum nbq_ggml_type {
    NBQ_GGML_Q4_0 = 2,
    NBQ_GGML_Q4_1 = 3,
    NBQ_GGML_Q5_0 = 6,
    NBQ_GGML_Q5_1 = 7,
    NBQ_GGML_Q8_0 = 8,
    NBQ_GGML_Q2_K = 10,
    NBQ_GGML_Q3_K = 11,
    NBQ_GGML_Q4_K = 12,
    NBQ_GGML_Q5_K = 13,
    NBQ_GGML_Q6_K = 14,
    NBQ_GGML_IQ4_NL = 20,
    NBQ_GGML_IQ4_XS = 23,
};

/* The matmul entry points' `flags` (nbq_weight.flags holds the weight's own). */
enum nbq_flag {
    NBQ_GATED = 1,   /* x is [a | b]: multiply silu(a) * b */
    NBQ_ROUND16 = 2, /* inputs of a few rows are rounded to 16 bits per block for the integer
                        row kernels, where the build has them (quant_matmul.c,
                        gguf_blocks.c) */
    NBQ_ROUND8 = 4,  /* inputs (any rows) are rounded to 8 bits per 256 (llama.cpp's Q8_K)
                        for Q4_K's and Q6_K's integer kernels, where the build has them
                        (gguf_blocks.c); ignored elsewhere, where the other flags decide */
    NBQ_ROUND8_MANY = 8, /* without NBQ_ROUND8: inputs of more than ROW_PATH_MAX rows are
                        rounded to 8 bits per 32 where gemm8 takes them (gguf_blocks_gemm8.h),
                        the flag ignored elsewhere (prompt chunks: execution/quant.py) */
};

/* One weight: kind NBQ_Q4 (codes, d, m), NBQ_Q8 (codes, d), NBQ_F32 (codes: the float32
 * rows) or NBQ_BLOCKS (codes: the rows of GGUF blocks of ggml type block_type, an enum
 * nbq_ggml_type); n outputs of k inputs; flags for its matmuls (NBQ_ROUND16, NBQ_ROUND8 or
 * 0). NBQ_PARTS: a fused weight whose parts differ in kind or type (a Q4_K q and k beside a
 * Q6_K v): `parts` weights at `part`, none of them parts, each of k inputs with its own flags,
 * giving the next of the n outputs in order (their n summed); its own flags, block_type and
 * pointers are unused. */
typedef struct nbq_weight {
    int32_t kind, n, k, flags, block_type, parts;
    const void *codes;
    const half_t *d, *m;
    const struct nbq_weight *part;
} nbq_weight;

/* One Llama-shaped layer of nbq_decode_stack. */
typedef struct {
    nbq_weight qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm; /* RMSNorm weights (hidden floats) */
    void *keys, *values;               /* this layer's cache: (blocks, hkv, block_size, d) */
} nbq_layer;

/* quant_matmul.c: y (rows, n) = prepare(x) (rows, k) @ w.T, prepare being RMSNorm with `norm`
 * and `eps` when norm is not NULL, silu(a) * b with NBQ_GATED; 0, or -1 when out of memory. */
int nbq_q4_matmul(const float *x, int rows, int k, const uint8_t *codes, const half_t *d,
                  const half_t *m, int n, float *y, int threads, const float *norm, float eps,
                  int flags);
int nbq_q8_matmul(const float *x, int rows, int k, const int8_t *codes, const half_t *d, int n,
                  float *y, int threads, const float *norm, float eps, int flags);
int nbq_f32_matmul(const float *x, int rows, int k, const float *w, int n, float *y,
                   int threads, const float *norm, float eps, int flags);
int nbq_simd_width(void);       /* the floats of the build's vectors: 16, 8 or 1 (plain C) */
int nbq_row_path_max(void);     /* the most input rows the row kernels take */
int nbq_round16_max_rows(void); /* the most rows NBQ_ROUND16 rounds (0: no such kernels) */

/* gguf_blocks.c: y (rows, n) = prepare(x) (rows, k) @ w.T for n weight rows stored as GGUF
 * blocks of `type` (enum nbq_ggml_type) exactly as the file lays them out, prepare as above;
 * dequantize: `count` rows (row_index[i] of the n_rows, or the first `count` when row_index is
 * NULL) as float32, exactly as gguf's dequantization. 0, -1 when out of memory, -2 for a type
 * not served, k not a multiple of its block or an index out of range. */
int nbq_blocks_matmul(const float *x, int rows, int k, int type, const void *blocks, int n,
                      float *y, int threads, const float *norm, float eps, int flags);
int nbq_blocks_dequantize(int type, const void *blocks, int n_rows, int k,
                          const int32_t *row_index, int count, float *out, int threads);
int nbq_blocks_supported(int type); /* 1 where this build serves the type, else 0 */
int nbq_block_elems(int type);      /* weights a block of the type (0: not served) */
int nbq_block_bytes(int type);      /* bytes a block of the type (0: not served) */
int nbq_blocks_rounded(int type);   /* 1 where NBQ_ROUND16 takes integer row kernels, else 0 */
int nbq_blocks_rounded8(int type);  /* 1 where NBQ_ROUND8 takes 8-bit row kernels, else 0 */
int nbq_blocks_rounded_many(int type); /* 1 where NBQ_ROUND16 takes inputs of any row count
                                           (built blocks: gemm16, gemm32), else 0 (past ROW_PATH_MAX
                                           rows: the exact panels) */
int nbq_blocks_rounded8_many(int type); /* 1 where NBQ_ROUND8 takes more than ROW_PATH_MAX rows
                                           through gemm8 (16 weight rows built once), else 0
                                           (the 8-bit row kernels, a chunk of rows at a time) */

/* paged_attention.c, over a float32 cache and (_f16) a float16 one; 0, -1 when out of memory,
 * -2 for invalid arguments. */
int nbq_paged_lone_attention(const float *heads, int hq, int hkv, int d, const float *cos,
                             const float *sin_signed, float *keys, float *values,
                             int block_size, const int32_t *table, int pos, float *out,
                             int threads);
int nbq_paged_decode_attention(const float *q, int batch, int hq, int hkv, int d,
                               const float *keys, const float *values, int block_size,
                               const int32_t *tables, int table_stride, const int32_t *lengths,
                               float *out, int threads);
int nbq_paged_decode_step(const float *heads, int batch, int hq, int hkv, int d,
                          const float *cos, const float *sin_signed, float *keys, float *values,
                          int block_size, const int32_t *tables, int table_stride,
                          const int32_t *positions, float *out, int threads);
int nbq_paged_lone_attention_f16(const float *heads, int hq, int hkv, int d, const float *cos,
                                 const float *sin_signed, _Float16 *keys, _Float16 *values,
                                 int block_size, const int32_t *table, int pos, float *out,
                                 int threads);
int nbq_paged_decode_attention_f16(const float *q, int batch, int hq, int hkv, int d,
                                   const _Float16 *keys, const _Float16 *values, int block_size,
                                   const int32_t *tables, int table_stride,
                                   const int32_t *lengths, float *out, int threads);
int nbq_paged_decode_step_f16(const float *heads, int batch, int hq, int hkv, int d,
                              const float *cos, const float *sin_signed, _Float16 *keys,
                              _Float16 *values, int block_size, const int32_t *tables,
                              int table_stride, const int32_t *positions, float *out,
                              int threads);

/* decode_stack.c: a decode step through every layer in one call (see there). */
int nbq_decode_stack(const nbq_layer *layers, int n_layers, int rows, int hidden, int hq,
                     int hkv, int d, float eps, int kv_f16, int block_size,
                     const int32_t *tables, int table_stride, const int32_t *positions,
                     const float *cos, const float *sin_signed, float *x, int threads,
                     double *spent);

#endif
