// The CPU kernels of compressed optimizer state (tierstore.optimizer.state_kernels): each one pass
// over a row that reads its inputs once and writes its outputs once, with the bits of the torch
// operations that define the format (state_kernels.py). state_kernels.py builds this file on first
// use and calls its C functions through ctypes, on the tensors' memory.
//
// The same IEEE fp32 operations as torch's, in the same order: no fused multiply-adds
// (-ffp-contract=off), no reassociation (no -ffast-math). On x86-64 the kernels also come in AVX2,
// chosen at run time where the CPU has it: the table lookups as AVX2 gathers, the rest by the
// compiler's vectoriser (target_clones).

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
