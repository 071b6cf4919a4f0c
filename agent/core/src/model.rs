//! KV geometry of real models and the request-trace record (the bench's pure
//! side). A request of `tokens` prompt tokens becomes `layers ×
//! ceil(tokens / block_tokens)` descriptors (twice that with K and V in
//! separate tensors), each `block_tokens × kv_heads / tp × head_dim ×
//! dtype_bytes` bytes (`shared/data/README.md`).

use serde::{Deserialize, Serialize};

/// A model's KV-cache geometry (facts from the models' public configs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelGeometry {
    /// Preset name, e.g. "Llama-3.1-8B".
    pub name: String,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads (GQA groups).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u32,
}

/// The presets of `shared/data/README.md`.
pub fn presets() -> Vec<ModelGeometry> {
    let m = |name: &str, layers, kv_heads, head_dim| ModelGeometry {
        name: name.to_string(),
        layers,
        kv_heads,
        head_dim,
        dtype_bytes: 2,
    };
    vec![
        m("Llama-3.1-8B", 32, 8, 128),
        m("Llama-3.1-70B", 80, 8, 128),
        m("Qwen2.5-7B", 28, 4, 128),
        m("gpt-oss-120b", 36, 8, 64),
    ]
}

/// Looks a preset up by name (case-insensitive).
///
/// # Errors
/// The list of known names when `name` is unknown.
pub fn preset(name: &str) -> Result<ModelGeometry, String> {
    presets()
        .into_iter()
        .find(|m| m.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            format!(
                "unknown model {name:?}; expected one of {}",
                presets()
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// How a model's KV cache is laid out for transfer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// The model.
    pub model: ModelGeometry,
    /// Tokens per paged block.
    pub block_tokens: u32,
    /// Tensor parallelism (divides the KV heads).
    pub tp: u32,
    /// K and V are separate tensors (two descriptors per layer and block).
    pub kv_split: bool,
}

impl KvLayout {
    /// Validates and builds a layout.
    ///
    /// # Errors
    /// When `block_tokens` or `tp` is 0, `tp` does not divide the KV heads,
    /// a field of the model's geometry is 0 (`layers`, `kv_heads`,
    /// `head_dim`, `dtype_bytes`: named in the message), or one block
    /// across all layers ([`Self::bytes_per_block`]) would not fit in a
    /// `u64`.
    pub fn new(
        model: ModelGeometry,
        block_tokens: u32,
        tp: u32,
        kv_split: bool,
    ) -> Result<Self, String> {
        if block_tokens == 0 {
            return Err("block size: expected at least 1 token per block, got 0".into());
        }
        for (field, v) in [
            ("layers", model.layers),
            ("kv_heads", model.kv_heads),
            ("head_dim", model.head_dim),
            ("dtype_bytes", model.dtype_bytes),
        ] {
            if v == 0 {
                return Err(format!(
                    "geometry of {}: {field} must be at least 1, got 0",
                    model.name
                ));
            }
        }
        if tp == 0 || model.kv_heads % tp != 0 {
            return Err(format!(
                "tp: expected a divisor of {}'s {} KV heads, got {tp}",
                model.name, model.kv_heads
            ));
        }
        let tensors = if kv_split { 2 } else { 1 };
        let per_block = [
            u64::from(model.kv_heads / tp),
            u64::from(model.head_dim),
            u64::from(model.dtype_bytes),
            2, // K and V, in one descriptor or in two tensors
            u64::from(model.layers),
        ]
        .into_iter()
        .try_fold(u64::from(block_tokens), u64::checked_mul);
        if per_block.is_none() {
            return Err(format!(
                "geometry of {}: one block of {block_tokens} tokens ({} layers x {tensors} tensors) overflows 64-bit byte counts",
                model.name, model.layers
            ));
        }
        Ok(Self {
            model,
            block_tokens,
            tp,
            kv_split,
        })
    }

    /// K/V tensors per layer: 2 when split, else 1.
    pub fn tensors_per_layer(&self) -> u32 {
        if self.kv_split {
            2
        } else {
            1
        }
    }

    /// Bytes of one descriptor (one block of one layer's K or V, or K+V
    /// when not split), per TP rank.
    pub fn descriptor_bytes(&self) -> u64 {
        let kv = if self.kv_split { 1 } else { 2 };
        u64::from(self.block_tokens)
            * u64::from(self.model.kv_heads / self.tp)
            * u64::from(self.model.head_dim)
            * u64::from(self.model.dtype_bytes)
            * kv
    }

    /// Paged blocks a prompt of `tokens` occupies.
    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.block_tokens))
    }

    /// Descriptors of one request of `tokens` prompt tokens.
    pub fn descriptors_for(&self, tokens: u64) -> u64 {
        self.blocks_for(tokens) * u64::from(self.model.layers) * u64::from(self.tensors_per_layer())
    }

    /// Bytes one paged block occupies across all layers and tensors (per TP
    /// rank).
    pub fn bytes_per_block(&self) -> u64 {
        self.descriptor_bytes() * u64::from(self.model.layers) * u64::from(self.tensors_per_layer())
    }
}

/// One line of a Mooncake trace (`shared/data/README.md`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival time (ms, relative to the first request).
    pub timestamp: u64,
    /// Prompt tokens (what prefill hands to decode).
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Prefix block hashes (one per 512 tokens).
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// Parses a JSONL trace; `start` lines are skipped and at most `limit`
/// records returned.
///
/// # Errors
/// The 1-based line number and the parse error of the first bad line.
pub fn parse_trace(text: &str, start: usize, limit: usize) -> Result<Vec<TraceRecord>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().skip(start) {
        if out.len() >= limit {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRecord =
            serde_json_lite(line).map_err(|e| format!("trace line {}: {e}", i + 1))?;
        out.push(r);
    }
    Ok(out)
}

/// serde_yaml parses JSON (a YAML subset); it keeps this crate free of
/// another JSON dependency.
fn serde_json_lite(line: &str) -> Result<TraceRecord, String> {
    serde_yaml::from_str(line).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_example_llama8b_tp4_split() {
        let l = KvLayout::new(preset("llama-3.1-8b").unwrap(), 16, 4, true).unwrap();
        assert_eq!(l.descriptor_bytes(), 8192);
        assert_eq!(l.descriptors_for(2000), 8000);
        // 131,072 bytes per token across all layers at TP 1.
        let full = KvLayout::new(preset("Llama-3.1-8B").unwrap(), 1, 1, false).unwrap();
        assert_eq!(full.bytes_per_block(), 131_072);
    }

    #[test]
    fn presets_match_readme_bytes_per_token() {
        let want = [131_072, 327_680, 57_344, 73_728];
        for (m, w) in presets().into_iter().zip(want) {
            let l = KvLayout::new(m, 1, 1, true).unwrap();
            assert_eq!(l.bytes_per_block(), w, "{}", l.model.name);
        }
    }

    #[test]
    fn bad_inputs_are_named() {
        assert!(preset("gpt-5").unwrap_err().contains("Llama-3.1-8B"));
        let e = KvLayout::new(preset("Qwen2.5-7B").unwrap(), 16, 8, true).unwrap_err();
        assert!(e.starts_with("tp:"), "{e}");
        assert!(KvLayout::new(preset("Qwen2.5-7B").unwrap(), 0, 1, true).is_err());
        let zero = ModelGeometry {
            head_dim: 0,
            ..preset("Qwen2.5-7B").unwrap()
        };
        let e = KvLayout::new(zero, 16, 1, true).unwrap_err();
        assert!(e.contains("head_dim"), "{e}");
        let huge = ModelGeometry {
            name: "huge".into(),
            layers: u32::MAX,
            kv_heads: u32::MAX,
            head_dim: u32::MAX,
            dtype_bytes: u32::MAX,
        };
        let e = KvLayout::new(huge, u32::MAX, 1, false).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
    }

    /// Mostly small values (0 included), some anywhere in `u32`.
    fn small_or_any() -> impl proptest::strategy::Strategy<Value = u32> {
        proptest::prop_oneof![0u32..=16, 0u32..=100_000, proptest::num::u32::ANY]
    }

    proptest::proptest! {
        /// Any layout `new` accepts computes its sizes without overflow.
        #[test]
        fn accepted_layouts_have_finite_sizes(
            layers in small_or_any(), kv_heads in small_or_any(),
            head_dim in small_or_any(), dtype_bytes in small_or_any(),
            block in small_or_any(), tp in small_or_any(), split: bool,
        ) {
            let m = ModelGeometry { name: "p".into(), layers, kv_heads, head_dim, dtype_bytes };
            if let Ok(l) = KvLayout::new(m, block, tp, split) {
                proptest::prop_assert!(l.bytes_per_block() >= l.descriptor_bytes());
                proptest::prop_assert!(l.descriptor_bytes() > 0);
            }
        }
    }

    #[test]
    fn parses_trace_lines_and_names_bad_ones() {
        let t = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n\
                 {\"timestamp\": 7, \"input_length\": 20, \"output_length\": 5, \"hash_ids\": []}\n";
        let r = parse_trace(t, 1, 10).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].timestamp, 7);
        let e = parse_trace("{\"timestamp\": \"x\"}\n", 0, 1).unwrap_err();
        assert!(e.starts_with("trace line 1"), "{e}");
    }
}
