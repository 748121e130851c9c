// The CPU kernels of compressed optimizer state (tierstore.optimizer.state_kernels): each one pass
// over a row that reads its inputs once and writes its outputs once, with the bits of the torch
// operations that define the format (state_kernels.py). state_kernels.py builds this file on first
// use and calls its C functions through ctypes, on the tensors' memory.
//
// The same IEEE fp32 operations as torch's, in the same order: no fused multiply-adds
// (-ffp-contract=off), no reassociation (no -ffast-math). On x86-64 the kernels also come in AVX2,
// chosen at run time where the CPU has it: the table lookups as AVX2 gathers, the rest by the
// compiler's vectoriser (target_clones).

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TIERSTORE_AVX2 1
#define VECTORISED __attribute__((target_clones("avx2", "default")))
#else
#define TIERSTORE_AVX2 0
#define VECTORISED
#endif

namespace {

constexpr int64_t kBlock = 256;                 // elements per block: state_kernels.BLOCK
constexpr int kBucketShift = 15;                // state_kernels._BUCKET_SHIFT
constexpr int32_t kLowBits = (1 << kBucketShift) - 1;
constexpr int32_t kBucketMask = (1 << 17) - 1;  // the bucket table's 2^17 entries
constexpr uint32_t kMagnitude = 0x7FFFFFFFu;    // an fp32's bits less its sign
constexpr uint32_t kInfinity = 0x7F800000u;
constexpr uint32_t kNaN = 0x7FC00000u;  // the NaN torch writes for math.nan

inline uint32_t bits_of(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
}

inline float float_of(uint32_t bits) {
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

// fp32 to bf16 rounded to nearest even, as torch converts: a NaN becomes 0xFFFF.
inline uint16_t to_bf16(float value) {
    uint32_t bits = bits_of(value);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return value == value ? static_cast<uint16_t>(rounded) : static_cast<uint16_t>(0xFFFFu);
}

inline float from_bf16(uint16_t half) { return float_of(static_cast<uint32_t>(half) << 16); }

// A block's largest magnitude from the largest of its values' bits with the signs cleared (they
// order as the magnitudes do, every NaN above infinity): the canonical NaN if any value is one.
inline float peak_of(uint32_t largest) { return largest > kInfinity ? float_of(kNaN) : float_of(largest); }

// The code of the map entry nearest to a normalised value, from its bits: its bucket's table entry
// plus its low bits, shifted; all bits inverted for a negative value of the signed map (flip -1).
inline uint8_t code_of(int32_t bits, const int32_t* table, int32_t flip) {
    int32_t entry = (table[(bits >> kBucketShift) & kBucketMask] + (bits & kLowBits)) >> kBucketShift;
    return static_cast<uint8_t>(entry ^ ((bits >> 31) & flip));
}

// One block (at most kBlock values): its largest magnitude into absmax, and each value divided by
// it (by 1 where it is 0 or NaN) as the code of the nearest map entry.
void quantise_block(const float* values, int64_t count, uint8_t* codes, float* absmax,
                    const int32_t* table, int32_t flip) {
    uint32_t largest = 0;
    for (int64_t i = 0; i < count; ++i) {
        uint32_t magnitude = bits_of(values[i]) & kMagnitude;
        largest = magnitude > largest ? magnitude : largest;
    }
    float peak = peak_of(largest);
    float divisor = peak > 0.0f ? peak : 1.0f;
    for (int64_t i = 0; i < count; ++i) {
        codes[i] = code_of(static_cast<int32_t>(bits_of(values[i] / divisor)), table, flip);
    }
    *absmax = peak;
}

void dequantise_block(const uint8_t* codes, int64_t count, float scale, const float* table, float* out) {
    for (int64_t i = 0; i < count; ++i) out[i] = table[codes[i]] * scale;
}

#if TIERSTORE_AVX2
// The low byte of each of eight 32-bit lanes, in order, as the low 8 bytes of the result.
__attribute__((target("avx2"))) inline __m128i low_bytes(__m256i lanes) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i picked = _mm256_shuffle_epi8(lanes, pick);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(picked), _mm256_extracti128_si256(picked, 1));
}

__attribute__((target("avx2"))) void quantise_block_avx2(const float* values, int64_t count, uint8_t* codes,
                                                         float* absmax, const int32_t* table, int32_t flip) {
    if (count % 8 != 0) {  // a short last block
        quantise_block(values, count, codes, absmax, table, flip);
        return;
    }
    const __m256i magnitude = _mm256_set1_epi32(static_cast<int32_t>(kMagnitude));
    __m256i largest = _mm256_setzero_si256();
    for (int64_t i = 0; i < count; i += 8) {
        __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(values + i));
        largest = _mm256_max_epu32(largest, _mm256_and_si256(bits, magnitude));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), largest);
    uint32_t most = 0;
    for (uint32_t lane : lanes) most = lane > most ? lane : most;
    float peak = peak_of(most);
    const __m256 divisor = _mm256_set1_ps(peak > 0.0f ? peak : 1.0f);
    const __m256i buckets = _mm256_set1_epi32(kBucketMask), low = _mm256_set1_epi32(kLowBits);
    const __m256i inverted = _mm256_set1_epi32(flip);
    for (int64_t i = 0; i < count; i += 8) {
        __m256i bits = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(values + i), divisor));
        __m256i bucket = _mm256_and_si256(_mm256_srai_epi32(bits, kBucketShift), buckets);
        __m256i entry = _mm256_i32gather_epi32(table, bucket, 4);
        entry = _mm256_srai_epi32(_mm256_add_epi32(entry, _mm256_and_si256(bits, low)), kBucketShift);
        entry = _mm256_xor_si256(entry, _mm256_and_si256(_mm256_srai_epi32(bits, 31), inverted));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), low_bytes(entry));
    }
    *absmax = peak;
}

__attribute__((target("avx2"))) void dequantise_block_avx2(const uint8_t* codes, int64_t count, float scale,
                                                           const float* table, float* out) {
    const __m256 factor = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(table, index, 4), factor));
    }
    dequantise_block(codes + i, count - i, scale, table, out + i);
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

// torch's fused AdamW (torch.optim.AdamW(fused=True), aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// its AVX2 build) element by element: its vector body, 8 elements at a time from the tensor's
// start, and its scalar tail, the tensor's last (length mod 8) elements, round differently; both
// are written with their operations explicit, torch's multiply-adds as fmaf.
struct AdamW {
    float decay;             // 1 - lr * weight_decay
    float lerp_weight;       // 1 - beta1
    float beta2;
    float square_weight;     // 1 - beta2
    float eps;
    float coefficient;       // the step's unscaling and clipping factor
    int32_t scale;           // whether to multiply the gradients by it (it is not 1)
    int32_t maximize;
};

struct PieceStep {
    int64_t offset;          // in the sub-group
    int64_t length;
    int64_t body;            // elements of torch's vector body: length - length % 8
    uint16_t* param;         // bf16, the piece's elements of its parameter
    const uint16_t* grad;    // bf16, or null: no gradient, no update
    float step_size;         // lr / bias_correction1
    float correction2_sqrt;  // sqrt(bias_correction2)
};

// torch's scalar tail, with the multiply-adds its build contracts it into (checked against
// torch._fused_adamw_): exp_avg_sq's product with beta2 is fused, the parameter's decay is not.
__attribute__((target("avx2,fma"))) float adamw_tail(float master, float& m, float& v, float g,
                                                     const AdamW& h, const PieceStep& piece) {
    master = master * h.decay;
    if (h.lerp_weight < 0.5f) {
        m = fmaf(h.lerp_weight, g - m, m);
    } else {
        m = fmaf(-(g - m), 1.0f - h.lerp_weight, g);
    }
    v = fmaf(v, h.beta2, h.square_weight * g * g);
    float denom = std::sqrt(v) / piece.correction2_sqrt + h.eps;
    return master - piece.step_size * m / denom;
}

// A block's elements [first, end) of the sub-group, all of one piece: master = param +
// compensation, updated where the piece has a gradient (its parameter then takes the master
// rounded), the compensation what the rounding left; m and v are the block's moments.
__attribute__((target("avx2,fma"))) void step_piece(const PieceStep& piece, int64_t first, int64_t end,
                                                    float* m, float* v, uint16_t* compensation,
                                                    const AdamW& h) {
    uint16_t* param = piece.param - piece.offset;  // both indexed by the element in the sub-group
    const uint16_t* grad = piece.grad == nullptr ? nullptr : piece.grad - piece.offset;
    if (grad == nullptr) {
        for (int64_t e = first; e < end; ++e) {
            float master = from_bf16(param[e]) + from_bf16(compensation[e]);
            compensation[e] = to_bf16(master - from_bf16(to_bf16(master)));
        }
        return;
    }
    int64_t body_end = piece.offset + piece.body;
    int64_t split = body_end < first ? first : (body_end > end ? end : body_end);
    // torch's vector body: an unscaled gradient is multiplied by 1 and a maximised one by -1, both
    // exact; the exponential average's two forms (torch's lerp) chosen by its weight, as torch does
    const float scale = h.scale ? h.coefficient : 1.0f, sign = h.maximize ? -1.0f : 1.0f;
    const bool small = h.lerp_weight < 0.5f;
    const float weight = small ? h.lerp_weight : h.lerp_weight - 1.0f;
    const float negative_step = -piece.step_size, correction = piece.correction2_sqrt;
    const float decay = h.decay, beta2 = h.beta2, square_weight = h.square_weight, eps = h.eps;
    for (int64_t e = first; e < split; ++e) {
        float g = from_bf16(grad[e]) * scale * sign;
        float master = (from_bf16(param[e]) + from_bf16(compensation[e])) * decay;
        float mi = m[e], vi = v[e];
        mi = fmaf(weight, g - mi, small ? mi : g);
        vi = fmaf(square_weight * g, g, vi * beta2);
        float denom = std::sqrt(vi) / correction + eps;
        master = master + (negative_step * mi) / denom;
        m[e] = mi;
        v[e] = vi;
        uint16_t rounded = to_bf16(master);
        param[e] = rounded;
        compensation[e] = to_bf16(master - from_bf16(rounded));
    }
    for (int64_t e = split; e < end; ++e) {  // torch's scalar tail
        float g = from_bf16(grad[e]);
        if (h.scale) g = g * h.coefficient;
        if (h.maximize) g = -g;
        float master = adamw_tail(from_bf16(param[e]) + from_bf16(compensation[e]), m[e], v[e], g, h, piece);
        uint16_t rounded = to_bf16(master);
        param[e] = rounded;
        compensation[e] = to_bf16(master - from_bf16(rounded));
    }
}
#endif

}  // namespace

extern "C" {

// 8-bit blockwise quantisation of the fp32 row `values` (`count` elements; the last block may be
// short) into `codes` and one `absmax` per block, by the bucket table `table`
// (state_kernels._bucket_table); `flip` is -1 for the signed map, else 0.
void tierstore_quantise(const float* values, int64_t count, uint8_t* codes, float* absmax,
                        const int32_t* table, int32_t flip) {
    for (int64_t start = 0; start < count; start += kBlock) {
        int64_t length = count - start < kBlock ? count - start : kBlock;
#if TIERSTORE_AVX2
        if (kHasAvx2) {
            quantise_block_avx2(values + start, length, codes + start, absmax + start / kBlock, table, flip);
            continue;
        }
#endif
        quantise_block(values + start, length, codes + start, absmax + start / kBlock, table, flip);
    }
}

// The inverse: each code's entry of the 256-entry `table` times its block's absmax, into `out`.
void tierstore_dequantise(const uint8_t* codes, const float* absmax, int64_t count, const float* table,
                          float* out) {
    for (int64_t start = 0; start < count; start += kBlock) {
        int64_t length = count - start < kBlock ? count - start : kBlock;
#if TIERSTORE_AVX2
        if (kHasAvx2) {
            dequantise_block_avx2(codes + start, length, absmax[start / kBlock], table, out + start);
            continue;
        }
#endif
        dequantise_block(codes + start, length, absmax[start / kBlock], table, out + start);
    }
}

// One AdamW step of a sub-group stored with int8 moments and a compensated bf16 master, block by
// block in the CPU's cache: the moments unpacked, the master the parameter plus its compensation,
// torch's fused AdamW (AdamW above), the parameter the master rounded, the compensation what it
// lost, the moments packed again: the elements [first, numel) (first a multiple of kBlock). Each piece
// is a parameter's elements in the sub-group, in order; elements of no piece keep their moments,
// with a compensation of zero. Returns 0 where the CPU has no AVX2 and FMA (nothing is done: the
// caller runs the kernels one by one).
int tierstore_adamw_int8_compensated(uint8_t* codes_m, float* absmax_m, uint8_t* codes_v, float* absmax_v,
                                     uint16_t* compensation, int64_t first, int64_t numel, const PieceStep* pieces,
                                     int64_t count, const AdamW* hyper, const float* signed_table,
                                     const float* unsigned_table, const int32_t* signed_buckets,
                                     const int32_t* unsigned_buckets) {
#if TIERSTORE_AVX2
    if (!kHasAvx2 || !__builtin_cpu_supports("fma")) return 0;
    alignas(32) float m[kBlock], v[kBlock];
    int64_t next = 0;  // the first piece that may reach the block
    for (int64_t start = first; start < numel; start += kBlock) {
        int64_t length = numel - start < kBlock ? numel - start : kBlock;
        while (next < count && pieces[next].offset + pieces[next].length <= start) ++next;
        dequantise_block_avx2(codes_m + start, length, absmax_m[start / kBlock], signed_table, m);
        dequantise_block_avx2(codes_v + start, length, absmax_v[start / kBlock], unsigned_table, v);
        int64_t covered = start;
        for (int64_t p = next; p < count && pieces[p].offset < start + length; ++p) {
            const PieceStep& piece = pieces[p];
            int64_t from = piece.offset > start ? piece.offset : start;
            int64_t end = piece.offset + piece.length < start + length ? piece.offset + piece.length : start + length;
            if (from >= end) continue;
            for (int64_t e = covered; e < from; ++e) compensation[e] = 0;
            step_piece(piece, from, end, m - start, v - start, compensation, *hyper);
            covered = end;
        }
        for (int64_t e = covered; e < start + length; ++e) compensation[e] = 0;
        quantise_block_avx2(m, length, codes_m + start, absmax_m + start / kBlock, signed_buckets, -1);
        quantise_block_avx2(v, length, codes_v + start, absmax_v + start / kBlock, unsigned_buckets, 0);
    }
    return 1;
#else
    return 0;
#endif
}

// The compensation term of fp32 master weights whose parameter is bf16: the master less its bf16
// rounding, rounded to bf16.
VECTORISED void tierstore_compensate_bf16(const float* master, int64_t count, uint16_t* compensation) {
    for (int64_t i = 0; i < count; ++i) compensation[i] = to_bf16(master[i] - from_bf16(to_bf16(master[i])));
}

// The fp32 master weights of a bf16 parameter: the parameter plus its compensation.
VECTORISED void tierstore_compensated_master_bf16(const uint16_t* param, const uint16_t* compensation,
                                                  int64_t count, float* master) {
    for (int64_t i = 0; i < count; ++i) master[i] = from_bf16(param[i]) + from_bf16(compensation[i]);
}

}  // extern "C"
