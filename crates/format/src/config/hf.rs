//! A Hugging Face `config.json`. Transformers 5 moved the RoPE settings into `rope_parameters`
//! and renamed `torch_dtype` to `dtype`; both layouts are read, and where a file has both they
//! must agree. A RoPE type or parameter brigade does not implement is an error that names it:
//! a default in its place would silently compute other numbers than the checkpoint was trained on.

use super::{bad, derived_head_dim, Arch, LayerSpec, ModelConfig, Moe, RopeScaling, RopeStyle};
use crate::{FormatError, GgmlType};
use serde::Deserialize;
use serde_json::{Map, Value};

/// The fields of a Hugging Face `config.json` that brigade reads.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    partial_rotary_factor: Option<f64>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    /// Qwen2-MoE's switch for its q/k/v biases (on by default).
    qkv_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<Value>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    query_pre_attn_scalar: Option<f64>,
    /// Gemma 3's local RoPE base in transformers 4's layout (5 nests it in `rope_parameters`).
    rope_local_base_freq: Option<f64>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    hidden_activation: Option<String>,
    use_bidirectional_attention: Option<bool>,
    /// Mixtral's expert count; the Qwen MoE families call it `num_experts`.
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    /// Qwen's expert size (Mixtral's experts are `intermediate_size`).
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    /// OLMo's clamp of q, k and v to ±`clip_qkv` (null in the released OLMoE).
    clip_qkv: Option<Value>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
}

/// transformers' `default_theta`.
const DEFAULT_THETA: f64 = 10_000.0;

pub(super) fn from_json(text: &str) -> Result<ModelConfig, FormatError> {
    // (serde_json's own errors give a line and column; the field's name is what a user fixes)
    let de = &mut serde_json::Deserializer::from_str(text);
    let hf: HfConfig = serde_path_to_error::deserialize(&mut *de)
        .map_err(|e| FormatError::BadConfig(format!("config.json: {}: {}", e.path(), e.inner())))?;
    de.end().map_err(|e| FormatError::BadConfig(format!("config.json: {e}")))?;
    let arch_name = hf.architectures.first().cloned().or(hf.model_type.clone()).unwrap_or_default();
    let family = super::family::by_hf(&arch_name).ok_or_else(|| FormatError::UnsupportedArch(arch_name.clone()))?;
    let arch = family.arch;
    let (sliding_window, swa_layers) = sliding_window(&hf, arch)?;
    let gemma_family = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
    if gemma_family {
        gemma(&hf)?;
    }
    if hf.num_attention_heads == 0 {
        return bad("zero attention heads".into());
    }
    // an explicit head size may differ from hidden / heads (the projections say which); without
    // one, the heads must split the hidden size evenly
    let head_dim = match hf.head_dim {
        Some(d) => d,
        None => derived_head_dim(hf.hidden_size, hf.num_attention_heads)?,
    };
    partial_rotary(hf.partial_rotary_factor, "partial_rotary_factor")?;
    if let Some(c) = hf.clip_qkv.as_ref().filter(|c| !c.is_null()) {
        return bad(format!("clip_qkv {c}: clamping q, k and v is not supported"));
    }
    if hf.mlp_bias == Some(true) {
        return bad("mlp_bias: biases on the feed-forward projections are not supported".into());
    }
    let (rope_theta, rope_scaling, rope_theta_local) = rope(&hf)?;
    let moe = moe(&hf, family)?;
    let cfg = ModelConfig {
        arch,
        n_layers: hf.num_hidden_layers,
        hidden: hf.hidden_size,
        ffn: hf.intermediate_size,
        n_heads: hf.num_attention_heads,
        n_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        head_dim,
        vocab: hf.vocab_size,
        rope_theta: rope_theta as f32,
        rope_style: RopeStyle::Halves,
        rope_scaling,
        rms_eps: hf.rms_norm_eps.unwrap_or(1e-5),
        context_length: hf.max_position_embeddings.unwrap_or(2048),
        layer: LayerSpec {
            qkv_bias: (family.layer.qkv_bias && hf.qkv_bias.unwrap_or(true)) || hf.attention_bias.unwrap_or(false),
            ..family.layer
        },
        rope_theta_local: match (rope_theta_local, hf.rope_local_base_freq) {
            (Some(a), Some(b)) if a != b => {
                return bad(format!(
                    "rope_parameters.sliding_attention.rope_theta {a} and rope_local_base_freq {b} disagree"
                ))
            }
            // Gemma 3's default when neither layout gives it (transformers' `default_theta["local"]`)
            (a, b) => a.or(b).or((arch == Arch::Gemma3).then_some(10_000.0)),
        }
        .filter(|_| sliding_window.is_some())
        .map(|t| t as f32),
        sliding_window,
        swa_layers,
        window_pass: None,
        embed_scale: family.scaled_embedding.then(|| (hf.hidden_size as f32).sqrt()),
        norm_offset: family.hf_norm_offset,
        query_pre_attn_scalar: if gemma_family { hf.query_pre_attn_scalar.or(Some(256.0)) } else { None },
        attn_softcap: hf.attn_logit_softcapping.filter(|_| gemma_family).map(|c| c as f32),
        final_softcap: hf.final_logit_softcapping.filter(|_| gemma_family).map(|c| c as f32),
        tie_word_embeddings: hf.tie_word_embeddings,
        dtype: dtype(&hf)?,
        moe,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The sliding window and the layers it applies to: Mistral's and Phi-3's `sliding_window` on
/// every layer (`null`: none), Gemma's on the `sliding_attention` layers of `layer_types`
/// (without it, as transformers fills it in: five in six for Gemma 3, every other for Gemma 2).
/// A Qwen family's `use_sliding_window` (windows from `max_window_layers` on) and `layer_types`
/// of any family but Gemma are refused by name; Llama and Qwen without `use_sliding_window`
/// ignore the field, as transformers does.
fn sliding_window(hf: &HfConfig, arch: Arch) -> Result<(Option<usize>, Option<Vec<bool>>), FormatError> {
    let window = || match &hf.sliding_window {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(w) if w > 0 => Ok(Some(usize::try_from(w).unwrap_or(usize::MAX))),
            _ => bad(format!("sliding_window {v}: a window is a positive number of positions")),
        },
    };
    if matches!(arch, Arch::Gemma2 | Arch::Gemma3) {
        let flags = match &hf.layer_types {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => bad(format!("layer_types: `{other}` layers are not supported")),
                })
                .collect::<Result<Vec<bool>, _>>()?,
            None => {
                // transformers' own filling in: five local layers in six (Gemma 3), every other (2)
                let n = hf.sliding_window_pattern.unwrap_or(if arch == Arch::Gemma2 { 2 } else { 6 }).max(1);
                super::swa_pattern(hf.num_hidden_layers, n)
            }
        };
        return match window()? {
            Some(w) => Ok((Some(w), Some(flags))),
            None if flags.iter().any(|f| *f) => {
                bad("layer_types: sliding_attention layers without a sliding_window".into())
            }
            None => Ok((None, None)),
        };
    }
    if let Some(t) = hf.layer_types.iter().flatten().find(|t| t.as_str() != "full_attention") {
        return bad(format!("layer_types: `{t}` layers are not supported (full_attention is)"));
    }
    match arch {
        Arch::Mistral | Arch::Phi3 | Arch::Mixtral => Ok((window()?, None)),
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe
            if hf.use_sliding_window == Some(true) && window()?.is_some() =>
        {
            bad("use_sliding_window: windows on the layers from max_window_layers on are not supported".into())
        }
        _ => Ok((None, None)),
    }
}

/// The experts of a MoE family's `config.json` (every layer's: dense layers between them,
/// `decoder_sparse_step` above 1 or `mlp_only_layers`, are refused by name); fields of experts
/// in a family without them are refused too, rather than ignored.
fn moe(hf: &HfConfig, family: &super::Family) -> Result<Option<Moe>, FormatError> {
    let experts = match (hf.num_local_experts, hf.num_experts) {
        (Some(a), Some(b)) if a != b => {
            return bad(format!("num_local_experts {a} and num_experts {b}: two expert counts that differ"));
        }
        (a, b) => a.or(b),
    };
    if !family.moe {
        if experts.is_some_and(|e| e > 0) {
            return bad(format!("num_experts {}: this family has no experts", experts.unwrap_or(0)));
        }
        return Ok(None);
    }
    let Some(experts) = experts else {
        return bad("num_experts (num_local_experts) is missing".into());
    };
    if hf.decoder_sparse_step.is_some_and(|s| s != 1) {
        return bad(format!(
            "decoder_sparse_step {}: dense layers between the expert layers are not supported",
            hf.decoder_sparse_step.unwrap_or(0)
        ));
    }
    if !hf.mlp_only_layers.is_empty() {
        return bad(format!(
            "mlp_only_layers {:?}: dense layers among the expert layers are not supported",
            hf.mlp_only_layers
        ));
    }
    let used = hf.num_experts_per_tok.ok_or_else(|| FormatError::BadConfig("num_experts_per_tok is missing".into()))?;
    Ok(Some(Moe {
        experts,
        used,
        ffn: hf.moe_intermediate_size.unwrap_or(hf.intermediate_size),
        // transformers: Mixtral always renormalises, the others as `norm_topk_prob` says (false
        // when absent)
        norm_topk: family.arch == Arch::Mixtral || hf.norm_topk_prob.unwrap_or(false),
        shared_ffn: hf.shared_expert_intermediate_size.filter(|_| family.arch == Arch::Qwen2Moe),
    }))
}

/// What Gemma 2 or 3 may ask for that brigade does not do, by name.
fn gemma(hf: &HfConfig) -> Result<(), FormatError> {
    match hf.hidden_activation.as_deref() {
        None | Some("gelu_pytorch_tanh") => {}
        Some(other) => return bad(format!("hidden_activation `{other}` is not supported (gelu_pytorch_tanh is)")),
    }
    if hf.use_bidirectional_attention == Some(true) {
        return bad("use_bidirectional_attention: only causal attention is supported".into());
    }
    // query_pre_attn_scalar is checked with the other scales by `ModelConfig::validate`
    Ok(())
}

/// `dtype` (transformers 5) or `torch_dtype` (4); both present must agree.
fn dtype(hf: &HfConfig) -> Result<Option<GgmlType>, FormatError> {
    let parse = |key: &str, s: &str| match s {
        "float32" => Ok(GgmlType::F32),
        "float16" => Ok(GgmlType::F16),
        "bfloat16" => Ok(GgmlType::BF16),
        other => bad(format!("{key} `{other}` is not supported (float32, float16, bfloat16 are)")),
    };
    let new = hf.dtype.as_deref().map(|s| parse("dtype", s)).transpose()?;
    let old = hf.torch_dtype.as_deref().map(|s| parse("torch_dtype", s)).transpose()?;
    match (new, old) {
        (Some(a), Some(b)) if a != b => bad(format!("dtype {a} and torch_dtype {b} disagree")),
        (a, b) => Ok(a.or(b)),
    }
}

fn partial_rotary(factor: Option<f64>, key: &str) -> Result<(), FormatError> {
    match factor {
        Some(f) if f != 1.0 => bad(format!("{key} {f}: rotary embeddings over part of a head are not supported")),
        _ => Ok(()),
    }
}

/// RoPE settings of either layout: `rope_parameters`, or top-level `rope_theta` + `rope_scaling`.
/// Also the RoPE base of the windowed layers where `rope_parameters` gives one per kind of layer
/// (Gemma 3: `{"full_attention": {…}, "sliding_attention": {…}}`); those are unscaled.
fn rope(hf: &HfConfig) -> Result<(f64, RopeScaling, Option<f64>), FormatError> {
    let object = |key: &str, v: &Option<Value>| -> Result<Option<Map<String, Value>>, FormatError> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m.clone())),
            Some(other) => bad(format!("{key} is {other}, not an object")),
        }
    };
    let mut params = object("rope_parameters", &hf.rope_parameters)?;
    let mut local = None;
    if let Some(m) = params.as_ref().filter(|m| m.contains_key("full_attention")) {
        let key = "rope_parameters.sliding_attention";
        if let Some(l) = object(key, &m.get("sliding_attention").cloned())? {
            let p = parse_rope(key, &l)?;
            if p.scaling != RopeScaling::None {
                return bad(format!("{key}: scaled RoPE on the windowed layers is not supported"));
            }
            local = Some(p.theta.unwrap_or(DEFAULT_THETA));
        }
        if let Some(k) = m.keys().find(|k| !["full_attention", "sliding_attention"].contains(&k.as_str())) {
            return bad(format!("rope_parameters: `{k}` beside full_attention is not supported"));
        }
        params = object("rope_parameters.full_attention", &m.get("full_attention").cloned())?;
    }
    let new = params.map(|m| parse_rope("rope_parameters", &m)).transpose()?;
    let old = object("rope_scaling", &hf.rope_scaling)?.map(|m| parse_rope("rope_scaling", &m)).transpose()?;
    let theta = match (new.as_ref().and_then(|p| p.theta), hf.rope_theta) {
        (Some(a), Some(b)) if a != b => {
            return bad(format!("rope_parameters.rope_theta {a} and rope_theta {b} disagree"))
        }
        (a, b) => a.or(b).unwrap_or(DEFAULT_THETA),
    };
    let scaling = match (new, old) {
        (Some(a), Some(b)) if a.scaling != b.scaling => {
            return bad(format!("rope_parameters ({:?}) and rope_scaling ({:?}) disagree", a.scaling, b.scaling))
        }
        (Some(p), _) | (None, Some(p)) => p.scaling,
        (None, None) => RopeScaling::None,
    };
    Ok((theta, scaling, local))
}

struct RopeParams {
    theta: Option<f64>,
    scaling: RopeScaling,
}

/// Keys every RoPE type may carry.
const COMMON_KEYS: [&str; 4] = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];

/// One RoPE object (`rope_parameters` or `rope_scaling`, whose `type` is the old `rope_type`).
fn parse_rope(key: &str, m: &Map<String, Value>) -> Result<RopeParams, FormatError> {
    let text = |k: &str| -> Result<Option<&str>, FormatError> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => bad(format!("{key}.{k} is {other}, not a string")),
        }
    };
    let kind = match (text("rope_type")?, text("type")?) {
        (Some(a), Some(b)) if a != b => return bad(format!("{key}: rope_type `{a}` and type `{b}` disagree")),
        (a, b) => a.or(b).unwrap_or("default").to_string(),
    };
    let number = |k: &str| -> Result<Option<f64>, FormatError> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                v.as_f64().map(Some).ok_or_else(|| FormatError::BadConfig(format!("{key}.{k} is {v}, not a number")))
            }
        }
    };
    let required = |k: &str| -> Result<f64, FormatError> {
        number(k)?.ok_or_else(|| FormatError::BadConfig(format!("{key}: rope type `{kind}` needs `{k}`")))
    };
    let type_keys: &[&str] = match kind.as_str() {
        "default" => &["factor"],
        "linear" => &["factor"],
        "llama3" => &["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
        other => {
            return bad(format!("{key}: rope type `{other}` is not supported (default, linear, llama3 are)"));
        }
    };
    if let Some(k) = m.keys().find(|k| !COMMON_KEYS.contains(&k.as_str()) && !type_keys.contains(&k.as_str())) {
        return bad(format!("{key}: `{k}` is not implemented for rope type `{kind}`"));
    }
    partial_rotary(number("partial_rotary_factor")?, &format!("{key}.partial_rotary_factor"))?;
    let scaling = match kind.as_str() {
        "linear" => RopeScaling::Linear { factor: required("factor")? as f32 },
        "llama3" => {
            let original = required("original_max_position_embeddings")?;
            if !(original.fract() == 0.0 && original >= 0.0 && original <= u32::MAX as f64) {
                return bad(format!("{key}.original_max_position_embeddings {original} is not a count"));
            }
            RopeScaling::Llama3 {
                factor: required("factor")? as f32,
                low_freq_factor: required("low_freq_factor")? as f32,
                high_freq_factor: required("high_freq_factor")? as f32,
                original_max_position: original as usize,
            }
        }
        // `default` ignores a factor, as transformers does, but only a neutral one is accepted
        _ => match number("factor")? {
            Some(f) if f != 1.0 => return bad(format!("{key}: factor {f} with rope type `default`")),
            _ => RopeScaling::None,
        },
    };
    Ok(RopeParams { theta: number("rope_theta")?, scaling })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA31: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;

    /// Llama 3.1 as transformers 5 saves it.
    const LLAMA31_V5: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rms_norm_eps": 1e-05, "max_position_embeddings": 131072, "dtype": "bfloat16", "head_dim": 128,
        "tie_word_embeddings": false,
        "rope_parameters": {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;

    fn parse(text: &str) -> Result<ModelConfig, FormatError> {
        ModelConfig::from_hf_json(text)
    }

    #[test]
    fn llama3_rope_scaling_matches_transformers() {
        let c = parse(LLAMA31).unwrap();
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.rope_style, RopeStyle::Halves);
        let f = c.rope_inv_freq();
        // transformers' _compute_llama3_parameters for this config
        let want = [
            (0, 1.0),
            (10, 0.12868737343265052),
            (20, 0.016560440080994446),
            (30, 0.0013718935677611381),
            (40, 3.428102195952591e-05),
            (50, 4.411534674558404e-06),
            (63, 3.068925988914511e-07),
        ];
        for (i, w) in want {
            assert!((f[i] as f64 - w).abs() <= 1e-6 * w, "inv_freq[{i}] = {} vs {w}", f[i]);
        }
    }

    #[test]
    fn transformers_5_layout_reads_as_the_old_one() {
        let old = parse(LLAMA31).unwrap();
        let new = parse(LLAMA31_V5).unwrap();
        assert_eq!(new.rope_theta, 500_000.0);
        assert_eq!(new.rope_scaling, old.rope_scaling);
        assert_eq!(new.rope_inv_freq(), old.rope_inv_freq());
        assert_eq!(new.dtype, Some(GgmlType::BF16));
        assert_eq!(new.tie_word_embeddings, Some(false));
        // the default type with its theta only
        let v5 = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300, "torch_dtype": "float16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}}"#;
        let c = parse(v5).unwrap();
        assert_eq!(
            (c.rope_theta, c.rope_scaling.clone(), c.dtype),
            (250_000.0, RopeScaling::None, Some(GgmlType::F16))
        );
        // the old `type` spelling of linear scaling
        let lin =
            v5.replace(r#"{"rope_type": "default", "rope_theta": 250000.0}"#, r#"{"type": "linear", "factor": 4}"#);
        assert_eq!(parse(&lin).unwrap().rope_scaling, RopeScaling::Linear { factor: 4.0 });
    }

    #[test]
    fn rope_settings_brigade_does_not_implement_are_named() {
        for (from, to, named) in [
            (r#""rope_type": "llama3"}"#, r#""rope_type": "yarn"}"#, "yarn"),
            (r#""rope_type": "llama3"}"#, r#""rope_type": "dynamic"}"#, "dynamic"),
            (r#""rope_type": "llama3"}"#, r#""rope_type": "longrope"}"#, "longrope"),
            (r#""rope_type": "llama3"}"#, r#""rope_type": "llama3", "attention_factor": 2.0}"#, "attention_factor"),
            (r#""rope_type": "llama3"}"#, r#""rope_type": "llama3", "partial_rotary_factor": 0.5}"#, "partial_rotary"),
            (r#""low_freq_factor": 1.0, "#, "", "low_freq_factor"),
            (r#""rope_theta": 500000.0, "#, r#""rope_theta": 10000.0, "#, "disagree"),
            (r#""dtype": "bfloat16""#, r#""dtype": "float8_e4m3fn""#, "float8_e4m3fn"),
        ] {
            assert!(LLAMA31_V5.contains(from), "{from}");
            let text = LLAMA31_V5.replacen(from, to, 1);
            // the theta case: the top-level and nested values disagree
            let text = if named == "disagree" {
                text.replacen("\"dtype\"", "\"rope_theta\": 500000.0, \"dtype\"", 1)
            } else {
                text
            };
            let e = parse(&text).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(named), "{named}: {e:?}");
        }
        // both layouts present must agree
        let both = LLAMA31.replacen(
            "\"rope_theta\"",
            r#""rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta""#,
            1,
        );
        assert!(parse(&both).err().map(|e| e.to_string()).unwrap_or_default().contains("disagree"));
        let top = LLAMA31.replacen("\"rope_theta\"", "\"partial_rotary_factor\": 0.25, \"rope_theta\"", 1);
        assert!(parse(&top).is_err());
        assert!(parse(&LLAMA31.replacen("\"rope_theta\"", "\"mlp_bias\": true, \"rope_theta\"", 1)).is_err());
    }

    #[test]
    fn rope_factors_that_give_non_finite_frequencies_are_refused() {
        for (from, to) in [
            (r#""high_freq_factor": 4.0"#, r#""high_freq_factor": 1.0"#),
            (r#""high_freq_factor": 4.0"#, r#""high_freq_factor": 0.5"#),
            (r#""factor": 8.0"#, r#""factor": 0.0"#),
            (r#""factor": 8.0"#, r#""factor": -2.0"#),
            (r#""low_freq_factor": 1.0"#, r#""low_freq_factor": 0.0"#),
            (r#""original_max_position_embeddings": 8192"#, r#""original_max_position_embeddings": 0"#),
            (r#""original_max_position_embeddings": 8192"#, r#""original_max_position_embeddings": 81.5"#),
            (r#""factor": 8.0"#, r#""factor": 1e999"#),
        ] {
            let text = LLAMA31.replacen(from, to, 1);
            let e = parse(&text).err().map(|e| e.to_string());
            assert!(e.is_some(), "{to} was accepted");
        }
        let e = parse(&LLAMA31.replacen(r#""high_freq_factor": 4.0"#, r#""high_freq_factor": 1.0"#, 1)).err();
        let e = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("low_freq_factor 1") && e.contains("high_freq_factor 1"), "{e}");
        let lin = LLAMA31.replacen("\"llama3\"", "\"linear\"", 1).replacen(r#""factor": 8.0"#, r#""factor": 0.0"#, 1);
        assert!(parse(&lin).is_err());
    }

    #[test]
    fn qwen2_has_biases_and_rotates_halves() {
        let j = r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768}"#;
        let c = parse(j).unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.layer.qkv_bias);
        assert_eq!(c.rope_style, RopeStyle::Halves);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.kv_bytes_per_token_layer(2), 2 * 2 * 64 * 2);
    }

    #[test]
    fn sliding_windows_are_read_where_they_apply_and_refused_where_they_cannot() {
        let mistral = r#"{"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "sliding_window": 4096}"#;
        let c = parse(mistral).unwrap();
        assert_eq!(c.sliding_window, Some(4096));
        let first = |p| crate::config::first_key(c.window(1), p);
        assert_eq!((first(4095), first(4096), first(10_000)), (0, 1, 5905));
        // Mistral v0.2 and later: no window
        assert_eq!(parse(&mistral.replace("4096", "null")).unwrap().sliding_window, None);
        assert_eq!(
            parse(&mistral.replace(",\n            \"sliding_window\": 4096", "")).unwrap().sliding_window,
            None
        );
        for (v, named) in
            [("0", "sliding_window 0"), ("-5", "sliding_window -5"), ("\"big\"", "sliding_window \"big\"")]
        {
            let e = parse(&mistral.replace("4096", v)).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(named), "{v}: {e}");
        }
        // Llama ignores the field, as transformers does
        let llama = mistral.replace("MistralForCausalLM", "LlamaForCausalLM");
        assert_eq!(parse(&llama).unwrap().sliding_window, None);
        // windows on some layers only are refused by name
        let qwen = mistral.replace("MistralForCausalLM", "Qwen2ForCausalLM");
        assert_eq!(parse(&qwen).unwrap().sliding_window, None);
        let e = parse(&qwen.replace("\"sliding_window\"", "\"use_sliding_window\": true, \"sliding_window\""));
        assert!(e.err().map(|e| e.to_string()).unwrap_or_default().contains("use_sliding_window"));
        let e = parse(&mistral.replace(
            "\"sliding_window\"",
            "\"layer_types\": [\"sliding_attention\", \"full_attention\"], \"sliding_window\"",
        ));
        assert!(e.err().map(|e| e.to_string()).unwrap_or_default().contains("layer_types: `sliding_attention`"));
    }

    #[test]
    fn phi3_stores_fused_projections() {
        // Phi-3-mini-4k's shape, as transformers 5 saves it
        let j = r#"{"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
            "original_max_position_embeddings": 4096, "max_position_embeddings": 4096, "sliding_window": 2047,
            "rope_parameters": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"}}"#;
        let c = parse(j).unwrap();
        assert_eq!(c.arch, Arch::Phi3);
        assert!(c.layer.fused_qkv && c.layer.fused_gate_up && !c.layer.qkv_bias);
        assert_eq!((c.rope_style, c.sliding_window), (RopeStyle::Halves, Some(2047)));
        // biases on the fused matrix, rotary over part of a head, LongRoPE: named, not ignored
        for (from, to, named) in [
            (r#""vocab_size""#, r#""attention_bias": true, "vocab_size""#, "attention_bias"),
            (r#""partial_rotary_factor": 1.0"#, r#""partial_rotary_factor": 0.75"#, "partial_rotary"),
            (r#""rope_type": "default""#, r#""rope_type": "longrope""#, "longrope"),
        ] {
            let e = parse(&j.replacen(from, to, 1)).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(named), "{named}: {e:?}");
        }
    }

    #[test]
    fn gemma3_reads_its_layers_and_names_what_it_cannot_do() {
        // Gemma 3 1B's shape as transformers 5 saves it
        let j = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
            "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 262144, "query_pre_attn_scalar": 256, "sliding_window": 512,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": null, "attn_logit_softcapping": null,
            "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}"#;
        let c = parse(j).unwrap();
        assert_eq!(c.arch, Arch::Gemma3);
        assert!(c.layer.post_norms && c.layer.gelu && c.layer.qk_norm && c.norm_offset == 1.0);
        assert_eq!((c.rope_theta, c.rope_theta_local, c.sliding_window), (1e6, Some(10_000.0), Some(512)));
        assert_eq!(c.embed_scale, Some((1152f32).sqrt()));
        assert_eq!(c.attention_scale(), 1.0 / 16.0);
        // five local layers, then a global one, as transformers fills layer_types in
        let flags = c.swa_layers.clone().unwrap();
        assert_eq!(flags.len(), 26);
        assert!((0..26).all(|i| flags[i] == ((i + 1) % 6 != 0)), "{flags:?}");
        assert_eq!((c.window(4), c.window(5), c.local_rope_theta(5)), (Some(512), None, None));
        // transformers 4's layout: a top-level theta and local base, the pattern by count
        let v4 = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
            "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 262144, "query_pre_attn_scalar": 256, "sliding_window": 512,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
            "rope_scaling": null, "torch_dtype": "bfloat16"}"#;
        let old = parse(v4).unwrap();
        assert_eq!(
            (old.rope_theta, old.rope_theta_local, old.swa_layers.clone()),
            (1e6, Some(10_000.0), c.swa_layers.clone())
        );
        let e = parse(&v4.replace(r#""rope_local_base_freq": 10000.0"#, r#""rope_local_base_freq": 10000.0, "rope_parameters": {"full_attention": {"rope_theta": 1000000.0}, "sliding_attention": {"rope_theta": 20000.0}}"#));
        assert!(e.err().map(|e| e.to_string()).unwrap_or_default().contains("disagree"));
        // explicit layer types win
        let typed = j.replacen(
            r#""sliding_window": 512"#,
            &format!(r#""sliding_window": 512, "layer_types": [{}]"#, vec![r#""full_attention""#; 26].join(",")),
            1,
        );
        assert!(parse(&typed).unwrap().swa_layers.unwrap().iter().all(|w| !w));
        for (from, to, named) in [
            (r#""final_logit_softcapping": null"#, r#""final_logit_softcapping": -30.0"#, "final_logit_softcapping"),
            (r#""attn_logit_softcapping": null"#, r#""attn_logit_softcapping": 0.0"#, "attn_logit_softcapping"),
            (r#""gelu_pytorch_tanh""#, r#""relu""#, "hidden_activation `relu`"),
            (r#""query_pre_attn_scalar": 256"#, r#""query_pre_attn_scalar": -1"#, "query_pre_attn_scalar -1"),
            (r#""rope_type": "default"}}"#, r#""rope_type": "linear", "factor": 2.0}}"#, "sliding_attention"),
            (
                r#""sliding_window": 512"#,
                r#""sliding_window": 512, "layer_types": ["chunked_attention"]"#,
                "chunked_attention",
            ),
        ] {
            assert!(j.contains(from), "{from}");
            let e = parse(&j.replacen(from, to, 1)).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(named), "{named}: {e:?}");
        }
    }

    #[test]
    fn head_sizes_are_explicit_or_exact() {
        // 100 / 6 is no head size (it was 16 once, rounded down)
        let j = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 96, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 6, "vocab_size": 300}"#;
        assert_eq!(parse(j).unwrap().head_dim, 16);
        assert!(parse(&j.replace("96", "100")).is_err());
        // an explicit head size wider than hidden / heads is the checkpoint's own (q is 6 × 32 wide)
        let wide = j.replace("\"vocab_size\"", "\"head_dim\": 32, \"vocab_size\"");
        let c = parse(&wide).unwrap();
        assert_eq!((c.head_dim, c.q_width()), (32, Some(192)));
    }

    /// OLMoE-1B-7B's `config.json` (transformers' OlmoeConfig): q and k normed whole, 64
    /// experts of `intermediate_size`, 8 per token, not renormalised; `clip_qkv` is refused by
    /// name rather than ignored.
    #[test]
    fn olmoe_reads_its_experts_and_whole_qk_norms() {
        let j = r#"{"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
            "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": 50304, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "num_experts": 64, "num_experts_per_tok": 8,
            "norm_topk_prob": false, "clip_qkv": null, "attention_bias": false, "tie_word_embeddings": false}"#;
        let c = parse(j).unwrap();
        assert_eq!(c.arch, Arch::Olmoe);
        assert!(c.layer.qk_norm && c.layer.qk_norm_whole && !c.layer.qkv_bias);
        let m = c.moe.unwrap();
        assert_eq!((m.experts, m.used, m.ffn, m.norm_topk, m.shared_ffn), (64, 8, 1024, false, None));
        use crate::tensors::LayerTensor as T;
        assert_eq!(T::AttnQNorm.shape(&c).unwrap(), vec![2048]);
        assert_eq!(T::AttnKNorm.shape(&c).unwrap(), vec![2048]);
        let clipped = j.replace("\"clip_qkv\": null", "\"clip_qkv\": 8.0");
        let e = parse(&clipped).unwrap_err().to_string();
        assert!(e.contains("clip_qkv 8.0"), "{e}");
        // a value of the wrong type is refused naming its field, not a line and column
        for (from, to, field) in [
            ("\"num_experts_per_tok\": 8", "\"num_experts_per_tok\": -1", "num_experts_per_tok"),
            ("\"norm_topk_prob\": false", "\"norm_topk_prob\": \"false\"", "norm_topk_prob"),
            ("\"num_experts\": 64", "\"num_experts\": 64.5", "num_experts"),
        ] {
            let e = parse(&j.replace(from, to)).unwrap_err().to_string();
            assert!(e.contains(&format!("config.json: {field}: ")), "{e}");
        }
        // two expert counts that differ: neither is taken
        let both = j.replace("\"num_experts\": 64", "\"num_experts\": 64, \"num_local_experts\": 8");
        let e = parse(&both).unwrap_err().to_string();
        assert!(e.contains("num_local_experts 8 and num_experts 64"), "{e}");
        // trailing text after the object is still refused
        assert!(parse(&format!("{j} x")).is_err());
    }

    #[test]
    fn rejects_bad_configs() {
        for bad in [
            LLAMA31.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 7"),
            LLAMA31.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": 0"),
            LLAMA31.replace("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\""),
            LLAMA31.replace("LlamaForCausalLM", "GPTNeoXForCausalLM"),
            LLAMA31.replace("\"hidden_size\": 4096", "\"hidden_size\": 40960000000"),
            // head sizes whose product with the head count overflows
            LLAMA31
                .replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 8, \"head_dim\": 4611686018427387904"),
            "{}".to_string(),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
    }
}
