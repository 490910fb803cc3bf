//! DRA device selectors: the CEL expressions of a DeviceClass's or a claim request's `selectors`,
//! evaluated against one device of a ResourceSlice as kube-scheduler 1.36 evaluates them, so that
//! the placer only picks devices kube-scheduler's allocator would pick too.
//!
//! Parsing and evaluation are cel-rust's (the `cel` crate); this module adds what Kubernetes
//! declares on top: the `device` variable, the `quantity` and `semver` libraries, `cel.bind`, and
//! a type check standing in for cel-go's (the crate has none), so that what kube-scheduler rejects
//! when compiling is rejected here too.
//!
//! # What kube-scheduler does
//!
//! Read in Kubernetes v1.36.2 (openshift/microshift's `deps/github.com/openshift/kubernetes`):
//!
//! - `staging/src/k8s.io/dynamic-resource-allocation/cel/compile.go`, `newCompiler`: `device` has
//!   `driver` (string), `attributes` (map domain → map name → value), `capacity` (map domain → map
//!   name → quantity) and, with `DRAConsumableCapacity` (beta and on by default since 1.36,
//!   `pkg/features/kube_features.go`), `allowMultipleAllocations` (false when unset). `cel.bind` is
//!   enabled; `includes()` and list-valued attributes only with the alpha `DRAListTypeAttributes`
//!   (off by default). `CompileCELExpression`: the expression is type-checked, and must be of type
//!   bool or unknown (an attribute value is `any`).
//! - Same file, `DeviceMatches`: first every attribute of the device is converted
//!   (`getAttributeValue`: int, bool, string, or a version parsed by blang/semver; a list, no value,
//!   or a version that does not parse is an error), so such a device fails every selector, whatever
//!   the selector reads. `parseQualifiedName`: a name without `/` is in the driver's domain,
//!   `domain/name` is `name` in `domain`. `newStringInterfaceMapWithDefault`: an unknown domain
//!   reads as an empty map, so `device.attributes["other.io"].x` is a "no such key" runtime error,
//!   as is a missing name in a known domain, and `has()` of either is false. A result that is not
//!   a bool is a runtime error.
//! - `staging/src/k8s.io/apiserver/pkg/cel/environment/base.go`: the libraries (the scheduler
//!   compiles with `StoredExpressions`, so all of them): the standard ones, cross-type numeric
//!   comparisons, homogeneous list and map literals, regex literals checked when compiling,
//!   strings extension version 2, `quantity` (`library/quantity.go`), `semver` version 1
//!   (`library/semverlib.go`), optional values, sets, lists, URLs, IPs, CIDRs, format,
//!   two-variable comprehensions.
//! - `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/
//!   allocator_incubating.go` (the allocator used when `DRAConsumableCapacity` is on),
//!   `selectorsMatch`: the class's selectors, then the request's, one after the other; the first
//!   that is false excludes the device (later ones are not evaluated), and a compile error or a
//!   runtime error is returned as `CEL compile error` / `CEL runtime error`. `isSelectable` and
//!   `allocateOne` hand that error up unchanged: it ends `Allocate` for the node, not just for
//!   that device.
//! - `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`, `Filter`: an error from
//!   `Allocate` other than a timeout or `ErrFailedAllocationOnNode` becomes an Error status
//!   ("something wrong with the claim or class ... abort scheduling"): the pod is not scheduled in
//!   this cycle at all and is retried with backoff. A compile error only shows when a device is
//!   first checked against that selector; the API server rejects such expressions when the class
//!   or claim is written, so in practice they come from version skew.
//!
//! So the placer must treat [`SelectorError::Compile`] and [`SelectorError::Runtime`] alike: the
//! claim cannot be allocated on that node, nor, as kube-scheduler would abort the pod's scheduling
//! attempt, should it be placed anywhere in this round. [`SelectorError::Unsupported`] means this
//! module cannot answer as kube-scheduler would: leave such a claim to kube-scheduler.
//!
//! # What is not reproduced
//!
//! Reported as [`SelectorError::Unsupported`] when compiling:
//! - functions outside the standard library, the strings extension (`format` and `strings.quote`
//!   excluded), `quantity` and `semver`: optional values (`.?`, `optional.*`, `orValue`), the lists,
//!   sets, regex (`find`), URL, IP, CIDR, format and authorizer libraries, timestamps and durations,
//!   two-variable comprehensions, message literals;
//! - `==`, `!=` and `in` applied to `device` or to its attribute or capacity maps themselves;
//! - expressions nested deeper than this evaluator runs safely on a thread's stack (the parser
//!   is given 250 levels, as cel-go; evaluation 32 levels of the expression tree, far beyond real
//!   selectors).
//!
//! Not detected, with the same outcome in practice:
//! - the runtime cost limit (`CELSelectorExpressionMaxCost`) is not enforced; the API server bounds
//!   the estimated cost of every stored expression;
//! - the type check is cel-go's where the types are known (literals, `device`'s fields, capacities,
//!   results of functions) and lets the rest through: an expression cel-go rejects only through
//!   inference this one does not do fails at evaluation instead, which ends the same way;
//! - quantities beyond 10^27 (cel-go takes any size) are errors here; a quantity's `isInteger()`
//!   follows apimachinery's int64-or-decimal representation, except that cel-go's `compareTo`
//!   also converts its receiver to the decimal one in place, which later calls would see;
//! - `matches` uses Rust's regex syntax, nearly but not exactly RE2's.
//!
//! # Cost
//!
//! Compile once per expression (about a millisecond: on a thread of its own with a large stack, as
//! the parser recurses) and reuse the [`Selector`]. Evaluating builds no copy of the device:
//! `device` is a view over the `Device` that looks a value up only when the expression reads it,
//! and strings are borrowed. Measured in a release build over 8000 T4 devices as the agent
//! publishes them (on a shared 2-core machine): 0.8 µs per device for `true`, which is the
//! conversion check of all 13 attributes kube-scheduler makes first (memory-bound: it touches
//! every attribute), 1.7 µs to compare one attribute, 4 µs for a `cel.bind` reading three. So 10 to
//! 40 ms per selector for 1000 nodes of 8 GPUs; [`selectors_match`] makes the check once for all.

use crate::quantity::Quantity;
use cel::common::ast::{
    CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedExpr, ListExpr, LiteralValue, MapExpr, StructExpr,
};
use cel::common::traits::{Container, Indexer, Iterable, Iterator as CelIterator, Sizer};
use cel::common::types::{CelBool, CelDouble, CelInt, CelString, MAP_TYPE, Type};
use cel::common::value::{CowVal, StaticVal, Val};
use cel::context::VariableResolver;
use cel::parser::{Macro, MacroExprHelper, ParseError, ParseErrors};
use cel::{Context, Env, ExecutionError, Value};
use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};
use std::any::Any;
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock, OnceLock};

/// cel-go's default limit on an expression's size, in code points.
const MAX_CODE_POINTS: usize = 100_000;
/// cel-go's default parser recursion limit: cel-rust's is lower (96).
const MAX_PARSE_DEPTH: u16 = 250;
/// The deepest expression tree evaluated: the interpreter recurses once per level, with large
/// frames in debug builds, on whatever thread calls [`Selector::matches`].
const MAX_TREE_DEPTH: usize = 32;
/// The stack of the thread that parses, for [`MAX_PARSE_DEPTH`] levels: ANTLR's frames take
/// about 8 KiB a level in a release build, some 200 KiB in a debug one (reserved, not touched).
const COMPILE_STACK_BYTES: usize = if cfg!(debug_assertions) { 64 << 20 } else { 8 << 20 };
const NANO: i128 = 1_000_000_000;

/// A selector's expression, compiled: compile once, evaluate per device.
#[derive(Debug)]
pub struct Selector {
    expression: String,
    /// Parsed, macros expanded.
    expr: IdedExpr,
}

/// Why a selector gave no answer for a device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// kube-scheduler fails to compile it (`CEL compile error`): the allocation on the node fails
    /// as for [`SelectorError::Runtime`], when the first device is checked against it.
    #[error("CEL compile error: {0}")]
    Compile(String),
    /// kube-scheduler fails to evaluate it for this device (`CEL runtime error`): the whole
    /// allocation attempt on the node fails, and kube-scheduler stops scheduling the pod this
    /// cycle; not just this device is excluded.
    #[error("CEL runtime error: {0}")]
    Runtime(String),
    /// Valid for kube-scheduler but not evaluated here (see the module's documentation): leave the
    /// claim to kube-scheduler.
    #[error("CEL not supported by gpumem's placer: {0}")]
    Unsupported(String),
}

impl Selector {
    /// Compiles `expression` as kube-scheduler does, with the checks of the module's documentation.
    pub fn compile(expression: &str) -> Result<Selector, SelectorError> {
        let size = expression.chars().count();
        if size > MAX_CODE_POINTS {
            return Err(SelectorError::Compile(format!(
                "expression code point size exceeds limit: size: {size}, limit {MAX_CODE_POINTS}"
            )));
        }
        let depth = parse_depth_estimate(expression);
        if depth > usize::from(MAX_PARSE_DEPTH) {
            return Err(SelectorError::Unsupported(format!(
                "nested about {depth} levels deep, more than the {MAX_PARSE_DEPTH} parsed here"
            )));
        }
        let env = environment()?;
        let source = expression.to_string();
        // The parser recurses per nesting level: parse, check and drop a rejected tree on a stack
        // sized for it rather than the caller's.
        let worker = std::thread::Builder::new()
            .name("cel-compile".into())
            .stack_size(COMPILE_STACK_BYTES)
            .spawn(move || compile_here(&env, source));
        match worker {
            Ok(handle) => handle
                .join()
                .unwrap_or_else(|_| Err(SelectorError::Unsupported("the CEL parser failed".into()))),
            Err(e) => Err(SelectorError::Unsupported(format!(
                "cannot start the CEL compiler: {e}"
            ))),
        }
    }

    /// The expression, as written.
    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// Whether `device`, published by `driver` (the slice's `spec.driver`), matches, as
    /// kube-scheduler's `DeviceMatches` answers it.
    pub fn matches(&self, driver: &str, device: &Device) -> Result<bool, SelectorError> {
        let env = environment()?;
        check_attributes(device)?;
        self.evaluate(env, driver, device)
    }

    fn evaluate(&self, env: Arc<Env>, driver: &str, device: &Device) -> Result<bool, SelectorError> {
        let input = DeviceVal::new(driver, device);
        // The interpreter is third-party code fed with users' expressions: a panic there is this
        // module's failure to answer, not the caller's.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut context = Context::with_env(env);
            context.set_variable_resolver(&input);
            let value = Value::resolve_val(&self.expr, &context)
                .map_err(|e| SelectorError::Runtime(e.to_string()))?;
            value
                .downcast_ref::<CelBool>()
                .map(|b| *b.inner())
                .ok_or_else(|| {
                    SelectorError::Runtime(format!(
                        "CEL result of type {} could not be converted to bool",
                        value.get_type().name()
                    ))
                })
        }))
        .unwrap_or_else(|_| Err(SelectorError::Unsupported("the CEL interpreter failed".into())))
    }
}

/// Whether `device` matches all `selectors`, as kube-scheduler's `selectorsMatch` answers it: in
/// order, the first false one ends it (the later ones are not evaluated, so their errors do not
/// show), as does the first error, a compile error included. Pass a DeviceClass's selectors, then
/// the request's.
pub fn selectors_match(
    selectors: &[Result<Selector, SelectorError>],
    driver: &str,
    device: &Device,
) -> Result<bool, SelectorError> {
    if selectors.is_empty() {
        return Ok(true);
    }
    let env = environment()?;
    for (i, selector) in selectors.iter().enumerate() {
        let selector = selector.as_ref().map_err(Clone::clone)?;
        // Converted before each evaluation there, with the same answer each time.
        if i == 0 {
            check_attributes(device)?;
        }
        if !selector.evaluate(Arc::clone(&env), driver, device)? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn compile_here(env: &Env, source: String) -> Result<Selector, SelectorError> {
    let expr = env
        .parser()
        .max_recursion_depth(MAX_PARSE_DEPTH)
        .parse(&source)
        .map_err(|e| SelectorError::Compile(describe(&e)))?;
    let depth = tree_depth(&expr);
    if depth > MAX_TREE_DEPTH {
        return Err(SelectorError::Unsupported(format!(
            "the expression is {depth} levels deep, more than the {MAX_TREE_DEPTH} evaluated here"
        )));
    }
    let mut checker = Checker {
        env,
        scopes: Vec::new(),
        unsupported: None,
    };
    let result = checker.check(&expr).map_err(SelectorError::Compile)?;
    if let Some(reason) = checker.unsupported {
        return Err(SelectorError::Unsupported(reason));
    }
    if !matches!(result, Ty::Bool | Ty::Dyn) {
        return Err(SelectorError::Compile(format!(
            "must evaluate to bool or the unknown type, not {}",
            result.name()
        )));
    }
    Ok(Selector {
        expression: source,
        expr,
    })
}

/// The parse errors, shortened: a message can quote the whole expression.
fn describe(errors: &ParseErrors) -> String {
    let shown: Vec<String> = errors
        .errors
        .iter()
        .take(3)
        .map(|e: &ParseError| {
            let msg: String = e.msg.chars().take(200).collect();
            format!("<input>:{}:{}: {msg}", e.pos.0, e.pos.1)
        })
        .collect();
    if shown.is_empty() {
        return "syntax error".into();
    }
    shown.join("; ")
}

/// An upper bound of the parser's recursion: bracket nesting plus, per bracket, the operators
/// since the last `&&`, `||` or `,` (left-recursive chains such as `a.b.c` or `1+2+3` nest one
/// level per operator). String literals are counted as code: that can only overestimate.
fn parse_depth_estimate(text: &str) -> usize {
    let bytes = text.as_bytes();
    let mut chains: Vec<usize> = vec![0];
    let (mut depth, mut max) = (0usize, 0usize);
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let next = bytes.get(i + 1).copied();
        let word = |c: Option<&u8>| c.is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_');
        let mut reset = false;
        match b {
            b'(' | b'[' | b'{' => {
                chains.push(0);
                depth += 1;
            }
            b')' | b']' | b'}' if chains.len() > 1 => {
                depth -= 1 + chains.pop().unwrap_or(0);
            }
            b',' => reset = true,
            b'&' | b'|' if next == Some(b) => {
                reset = true;
                i += 1;
            }
            b'.' | b'+' | b'-' | b'*' | b'/' | b'%' | b'<' | b'>' | b'=' | b'!' | b'?' | b':' => {
                depth += 1;
                if let Some(last) = chains.last_mut() {
                    *last += 1;
                }
            }
            b'i' if next == Some(b'n')
                && !word(i.checked_sub(1).and_then(|p| bytes.get(p)))
                && !word(bytes.get(i + 2)) =>
            {
                depth += 1;
                if let Some(last) = chains.last_mut() {
                    *last += 1;
                }
            }
            _ => {}
        }
        if reset && let Some(last) = chains.last_mut() {
            depth -= *last;
            *last = 0;
        }
        max = max.max(depth);
        i += 1;
    }
    max
}

/// The depth of the expression tree (macros expanded).
fn tree_depth(e: &IdedExpr) -> usize {
    let children = match &e.expr {
        Expr::Call(c) => c
            .target
            .iter()
            .map(|t| tree_depth(t))
            .chain(c.args.iter().map(tree_depth))
            .max(),
        Expr::Comprehension(c) => [&c.iter_range, &c.accu_init, &c.loop_cond, &c.loop_step, &c.result]
            .into_iter()
            .map(tree_depth)
            .max(),
        Expr::List(l) => l.elements.iter().map(tree_depth).max(),
        Expr::Map(MapExpr { entries }) | Expr::Struct(StructExpr { entries, .. }) => entries
            .iter()
            .map(|entry| match &entry.expr {
                EntryExpr::MapEntry(m) => tree_depth(&m.key).max(tree_depth(&m.value)),
                EntryExpr::StructField(f) => tree_depth(&f.value),
            })
            .max(),
        Expr::Select(s) => Some(tree_depth(&s.operand)),
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => None,
    };
    1 + children.unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// The environment: cel-rust's standard library and strings extension, and Kubernetes' additions.

static ENVIRONMENT: LazyLock<Result<Arc<Env>, String>> =
    LazyLock::new(|| build_environment().map(Arc::new).map_err(|e| e.to_string()));

fn environment() -> Result<Arc<Env>, SelectorError> {
    ENVIRONMENT
        .as_ref()
        .map(Arc::clone)
        .map_err(|e| SelectorError::Unsupported(format!("CEL environment: {e}")))
}

fn build_environment() -> Result<Env, cel::DeclarationError> {
    let mut env = Env::stdlib();
    cel::extensions::strings(&mut env)?;
    env.add_macro(Macro::receiver("bind", 3, bind_macro))?;
    // library/quantity.go
    cel::add_overload!(env, fn quantity: (CelString) -> Result<Qty>)?;
    cel::add_overload!(env, fn is_quantity: (CelString) -> CelBool)?;
    cel::add_overload!(env, fn sign: (Qty) -> CelInt)?;
    cel::add_member_overload!(env, fn is_greater_than: (Qty, Qty) -> CelBool)?;
    cel::add_member_overload!(env, fn is_less_than: (Qty, Qty) -> CelBool)?;
    cel::add_member_overload!(env, fn compare_to: (Qty, Qty) -> CelInt)?;
    cel::add_member_overload!(env, fn as_approximate_float: (Qty) -> CelDouble)?;
    cel::add_member_overload!(env, fn as_integer: (Qty) -> Result<CelInt>)?;
    cel::add_member_overload!(env, fn is_integer: (Qty) -> CelBool)?;
    cel::add_member_overload!(env, fn add: (Qty, Qty) -> Result<Qty>)?;
    cel::add_member_overload!(env, fn add_int: (Qty, CelInt) -> Result<Qty>, name = "add")?;
    cel::add_member_overload!(env, fn sub: (Qty, Qty) -> Result<Qty>)?;
    cel::add_member_overload!(env, fn sub_int: (Qty, CelInt) -> Result<Qty>, name = "sub")?;
    // library/semverlib.go, version 1
    cel::add_overload!(env, fn semver: (CelString) -> Result<Semver>)?;
    cel::add_overload!(env, fn semver_normalize: (CelString, CelBool) -> Result<Semver>, name = "semver")?;
    cel::add_overload!(env, fn is_semver: (CelString) -> CelBool)?;
    cel::add_overload!(env, fn is_semver_normalize: (CelString, CelBool) -> CelBool, name = "isSemver")?;
    cel::add_member_overload!(env, fn semver_is_greater_than: (Semver, Semver) -> CelBool, name = "isGreaterThan")?;
    cel::add_member_overload!(env, fn semver_is_less_than: (Semver, Semver) -> CelBool, name = "isLessThan")?;
    cel::add_member_overload!(env, fn semver_compare_to: (Semver, Semver) -> CelInt, name = "compareTo")?;
    cel::add_member_overload!(env, fn major: (Semver) -> CelInt)?;
    cel::add_member_overload!(env, fn minor: (Semver) -> CelInt)?;
    cel::add_member_overload!(env, fn patch: (Semver) -> CelInt)?;
    Ok(env)
}

/// `cel.bind(name, init, body)` (cel-go's ext.Bindings): `body` with `name` bound to `init`,
/// expanded as there into a comprehension over nothing whose accumulator is `name`.
fn bind_macro(
    helper: &mut MacroExprHelper<'_>,
    target: &mut Option<IdedExpr>,
    args: &mut Vec<IdedExpr>,
) -> Result<Option<IdedExpr>, ParseError> {
    if !matches!(target.as_ref().map(|t| &t.expr), Some(Expr::Ident(ns)) if ns == "cel") {
        return Ok(None);
    }
    let (Some(body), Some(init), Some(var)) = (args.pop(), args.pop(), args.pop()) else {
        return Err(helper.new_error(0, "cel.bind() takes a name, a value and an expression"));
    };
    let Expr::Ident(name) = var.expr else {
        return Err(helper.new_error(var.id, "cel.bind() variable names must be simple identifiers"));
    };
    let bind = ComprehensionExpr {
        iter_range: helper.next_expr(Expr::List(ListExpr::new(Vec::new()))),
        iter_var: "#unused".into(),
        iter_var2: None,
        accu_var: name.clone(),
        accu_init: init,
        loop_cond: helper.next_expr(Expr::Literal(LiteralValue::Boolean(false.into()))),
        loop_step: helper.next_expr(Expr::Ident(name)),
        result: body,
    };
    Ok(Some(helper.next_expr(Expr::Comprehension(Box::new(bind)))))
}

// ---------------------------------------------------------------------------------------------
// The `device` variable: a view over the `Device`, read on access.

/// Each attribute's value as `getAttributeValue` converts it, before any evaluation: an error
/// fails every selector on this device.
fn check_attributes(device: &Device) -> Result<(), SelectorError> {
    for (name, attribute) in device.attributes.iter().flatten() {
        attribute_value(attribute).map_err(|e| SelectorError::Runtime(format!("attribute {name}: {e}")))?;
    }
    Ok(())
}

/// An attribute's value, converted.
enum AttributeValue<'v> {
    Int(i64),
    Bool(bool),
    String(&'v str),
    Version(Semver),
}

impl<'v> AttributeValue<'v> {
    fn into_val(self) -> Box<dyn Val + 'v> {
        match self {
            AttributeValue::Int(i) => Box::new(CelInt::from(i)),
            AttributeValue::Bool(b) => Box::new(CelBool::from(b)),
            AttributeValue::String(s) => Box::new(CelString::from(s)),
            AttributeValue::Version(v) => Box::new(v),
        }
    }
}

/// `getAttributeValue`, list values off (`DRAListTypeAttributes` is alpha in 1.36).
fn attribute_value(attribute: &DeviceAttribute) -> Result<AttributeValue<'_>, String> {
    if let Some(i) = attribute.int {
        Ok(AttributeValue::Int(i))
    } else if let Some(b) = attribute.bool {
        Ok(AttributeValue::Bool(b))
    } else if let Some(s) = &attribute.string {
        Ok(AttributeValue::String(s))
    } else if let Some(v) = &attribute.version {
        Semver::parse(v)
            .map(AttributeValue::Version)
            .map_err(|e| format!("parse semantic version: {e}"))
    } else {
        Err("unsupported attribute value".into())
    }
}

/// `domain/name`, or `name` in the driver's domain.
fn qualified<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    split_once(name, b'/').unwrap_or((driver, name))
}

/// `str::split_once` for an ASCII byte, without the general searcher: these strings are short
/// and split for every device.
fn split_once(s: &str, at: u8) -> Option<(&str, &str)> {
    let i = s.bytes().position(|b| b == at)?;
    Some((&s[..i], &s[i + 1..]))
}

static DEVICE_TYPE: Type = Type::new_unspecified_type("kubernetes.DRADevice");

#[derive(Debug, Clone)]
struct DeviceVal<'a> {
    driver: CelString<'a>,
    allow_multiple_allocations: CelBool,
    attributes: Domains<'a>,
    capacity: Domains<'a>,
}

impl<'a> DeviceVal<'a> {
    fn new(driver: &'a str, device: &'a Device) -> DeviceVal<'a> {
        let view = View { driver, device };
        DeviceVal {
            driver: CelString::from(driver),
            allow_multiple_allocations: CelBool::from(device.allow_multiple_allocations.unwrap_or(false)),
            attributes: Domains {
                view,
                of: Of::Attributes,
                keys: OnceLock::new(),
            },
            capacity: Domains {
                view,
                of: Of::Capacity,
                keys: OnceLock::new(),
            },
        }
    }
}

impl VariableResolver for DeviceVal<'_> {
    fn resolve<'b>(&'b self, variable: &str) -> Option<CowVal<'b, 'b>> {
        (variable == "device").then(|| CowVal::Borrowed(self as &dyn Val))
    }
}

/// The string an index or a field name is, else the error the interpreter reports as a
/// no-matching-overload.
fn key_of(idx: &dyn Val) -> Result<&str, ExecutionError> {
    idx.downcast_ref::<CelString>()
        .map(CelString::inner)
        .ok_or_else(|| ExecutionError::UnexpectedType {
            got: idx.get_type().name().into(),
            want: "string".into(),
        })
}

impl Indexer for DeviceVal<'_> {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let field: &(dyn Val + 'v) = match key_of(idx)? {
            "driver" => &self.driver,
            "allowMultipleAllocations" => &self.allow_multiple_allocations,
            "attributes" => &self.attributes,
            "capacity" => &self.capacity,
            other => return Err(ExecutionError::no_such_key(other)),
        };
        Ok(CowVal::Borrowed(field))
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Val for DeviceVal<'_> {
    fn get_type(&self) -> &Type {
        &DEVICE_TYPE
    }

    fn cel_type() -> &'static Type {
        &DEVICE_TYPE
    }

    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }

    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
    where
        Self: 'v,
    {
        Box::new(self.clone())
    }
}

#[derive(Debug, Clone, Copy)]
struct View<'a> {
    driver: &'a str,
    device: &'a Device,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Of {
    Attributes,
    Capacity,
}

impl<'a> View<'a> {
    /// The names of the attributes, or of the capacities.
    fn names(self, of: Of) -> impl std::iter::Iterator<Item = &'a str> + 'a {
        let attributes = (of == Of::Attributes).then_some(&self.device.attributes);
        let capacity = (of == Of::Capacity).then_some(&self.device.capacity);
        let attributes = attributes.into_iter().flatten().flat_map(BTreeMap::keys);
        let capacity = capacity.into_iter().flatten().flat_map(BTreeMap::keys);
        attributes.chain(capacity).map(String::as_str)
    }

    /// `domain` as a slice of the device's own names, if anything is in it.
    fn domain(self, of: Of, domain: &str) -> Option<&'a str> {
        self.names(of)
            .map(|n| qualified(n, self.driver).0)
            .find(|d| *d == domain)
    }

    /// The device's own copy of `name`, if it has an attribute or capacity of that full name.
    fn stored(self, of: Of, name: &str) -> Option<&'a str> {
        let stored = match of {
            Of::Attributes => self
                .device
                .attributes
                .as_ref()?
                .get_key_value(name)
                .map(|(k, _)| k),
            Of::Capacity => self.device.capacity.as_ref()?.get_key_value(name).map(|(k, _)| k),
        };
        stored.map(String::as_str)
    }

    /// The full name of `id` in `domain`.
    fn find(self, of: Of, domain: &str, id: &str) -> Option<&'a str> {
        // The common case, an unqualified name of the driver, without a scan.
        match self.stored(of, id) {
            Some(name) if domain == self.driver && !name.contains('/') => Some(name),
            _ => self.names(of).find(|n| qualified(n, self.driver) == (domain, id)),
        }
    }

    /// The value of the attribute or capacity of that full name.
    fn value<'v>(self, of: Of, name: &str) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        'a: 'v,
    {
        let failed = |e: String| ExecutionError::function_error("device", format!("{name}: {e}"));
        match of {
            Of::Attributes => {
                let attribute = self.device.attributes.as_ref().and_then(|a| a.get(name));
                attribute
                    .ok_or_else(|| ExecutionError::no_such_key(name))
                    .and_then(|a| attribute_value(a).map(AttributeValue::into_val).map_err(failed))
            }
            Of::Capacity => {
                let capacity = self.device.capacity.as_ref().and_then(|c| c.get(name));
                let capacity = capacity.ok_or_else(|| ExecutionError::no_such_key(name))?;
                Qty::parse(&capacity.value.0)
                    .map(|q| Box::new(q) as Box<dyn Val>)
                    .map_err(failed)
            }
        }
    }
}

/// Sorted, without duplicates, borrowed from the device.
fn sorted_keys<'a>(keys: impl std::iter::Iterator<Item = &'a str>) -> Vec<CelString<'a>> {
    let mut keys: Vec<&str> = keys.collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter().map(CelString::from).collect()
}

struct Keys<'b, 'a>(std::slice::Iter<'b, CelString<'a>>);

impl<'b, 'v, 'a: 'v> CelIterator<'b, 'v> for Keys<'b, 'a> {
    fn next(&mut self) -> Option<&'b (dyn Val + 'v)> {
        self.0.next().map(|k| k as &dyn Val)
    }
}

/// `device.attributes` or `device.capacity`: domain → the names in it. An unknown domain reads as
/// an empty map (compile.go's `newStringInterfaceMapWithDefault`).
#[derive(Debug, Clone)]
struct Domains<'a> {
    view: View<'a>,
    of: Of,
    /// For iterating, made on the first.
    keys: OnceLock<Vec<CelString<'a>>>,
}

impl<'a> Domains<'a> {
    fn keys(&self) -> &[CelString<'a>] {
        self.keys
            .get_or_init(|| sorted_keys(self.view.names(self.of).map(|n| qualified(n, self.view.driver).0)))
    }
}

impl Indexer for Domains<'_> {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let domain = self.view.domain(self.of, key_of(idx)?);
        Ok(CowVal::owned(Names {
            view: self.view,
            of: self.of,
            domain,
            keys: OnceLock::new(),
        }))
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Container for Domains<'_> {
    fn contains(&self, value: &dyn Val) -> Result<bool, ExecutionError> {
        Ok(self.view.domain(self.of, key_of(value)?).is_some())
    }
}

impl Sizer for Domains<'_> {
    fn size(&self) -> CelInt {
        CelInt::from(self.keys().len() as i64)
    }
}

impl Iterable for Domains<'_> {
    fn iter<'b, 'v>(&'b self) -> Box<dyn CelIterator<'b, 'v> + 'b>
    where
        Self: 'v,
    {
        Box::new(Keys(self.keys().iter()))
    }
}

/// The names of one domain, and their values.
#[derive(Debug, Clone)]
struct Names<'a> {
    view: View<'a>,
    of: Of,
    /// None: nothing of the device is in that domain.
    domain: Option<&'a str>,
    keys: OnceLock<Vec<CelString<'a>>>,
}

impl<'a> Names<'a> {
    fn find(&self, id: &str) -> Option<&'a str> {
        self.domain.and_then(|d| self.view.find(self.of, d, id))
    }

    fn keys(&self) -> &[CelString<'a>] {
        self.keys.get_or_init(|| match self.domain {
            None => Vec::new(),
            Some(domain) => sorted_keys(
                self.view
                    .names(self.of)
                    .map(|n| qualified(n, self.view.driver))
                    .filter(|(d, _)| *d == domain)
                    .map(|(_, id)| id),
            ),
        })
    }
}

impl Indexer for Names<'_> {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let id = key_of(idx)?;
        let name = self.find(id).ok_or_else(|| ExecutionError::no_such_key(id))?;
        self.view.value(self.of, name).map(CowVal::Owned)
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Container for Names<'_> {
    fn contains(&self, value: &dyn Val) -> Result<bool, ExecutionError> {
        Ok(self.find(key_of(value)?).is_some())
    }
}

impl Sizer for Names<'_> {
    fn size(&self) -> CelInt {
        CelInt::from(self.keys().len() as i64)
    }
}

impl Iterable for Names<'_> {
    fn iter<'b, 'v>(&'b self) -> Box<dyn CelIterator<'b, 'v> + 'b>
    where
        Self: 'v,
    {
        Box::new(Keys(self.keys().iter()))
    }
}

/// The `Val` of a read-only map view: its type is `map`, so `size()`, `in`, `has()` and the
/// comprehensions treat it as one.
macro_rules! map_view_val {
    ($t:ident) => {
        impl Val for $t<'_> {
            fn get_type(&self) -> &Type {
                &MAP_TYPE
            }

            fn cel_type() -> &'static Type {
                &MAP_TYPE
            }

            fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
            where
                Self: 'v,
            {
                Some(self)
            }

            fn as_container(&self) -> Option<&dyn Container> {
                Some(self)
            }

            fn as_sizer(&self) -> Option<&dyn Sizer> {
                Some(self)
            }

            fn as_iterable<'b, 'v>(&'b self) -> Option<&'b (dyn Iterable + 'v)>
            where
                Self: 'v,
            {
                Some(self)
            }

            fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
            where
                Self: 'v,
            {
                Box::new(self.clone())
            }
        }
    };
}

map_view_val!(Domains);
map_view_val!(Names);

// ---------------------------------------------------------------------------------------------
// kubernetes.Quantity (apiserver/pkg/cel/quantity.go, library/quantity.go).

/// How apimachinery holds a quantity, which `isInteger`, `asInteger` and `asApproximateFloat` see:
/// an int64 times 10^scale, or an `inf.Dec` (whose scale counts decimals).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Repr {
    Int { value: i64, scale: i32 },
    Dec { scale: i32 },
}

/// A quantity: its exact value in nano-units and apimachinery's representation of it.
#[derive(Debug, Clone, Copy)]
struct Qty {
    nanos: i128,
    repr: Repr,
}

static QUANTITY_TYPE: Type = Type::new_unspecified_type("kubernetes.Quantity");

impl Val for Qty {
    fn get_type(&self) -> &Type {
        &QUANTITY_TYPE
    }

    fn cel_type() -> &'static Type {
        &QUANTITY_TYPE
    }

    /// `Quantity.Equal`: the same value, however written.
    fn equals(&self, other: &dyn Val) -> bool {
        other.downcast_ref::<Qty>().is_some_and(|o| o.nanos == self.nanos)
    }

    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(*self)
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

impl StaticVal for Qty {}

impl Qty {
    /// `resource.ParseQuantity`: the value from [`Quantity`], the representation from the text.
    fn parse(text: &str) -> Result<Qty, String> {
        let parsed = Quantity::parse(text).map_err(|e| e.to_string())?;
        if let Some((value, scale)) = go_int64_amount(text) {
            let nanos = int_nanos(value, scale).ok_or("quantity too large")?;
            return Ok(Qty {
                nanos,
                repr: Repr::Int { value, scale },
            });
        }
        // Parsed into an inf.Dec, rounded up to nano-units.
        let nanos = exact_nanos(&parsed).ok_or("quantity too large")?;
        Ok(Qty {
            nanos,
            repr: Repr::Dec { scale: 9 },
        })
    }

    /// The scale of its `inf.Dec` form.
    fn dec_scale(self) -> i32 {
        match self.repr {
            Repr::Int { scale, .. } => -scale,
            Repr::Dec { scale } => scale,
        }
    }

    /// `Quantity.AsInt64`.
    fn as_int64(self) -> Option<i64> {
        match self.repr {
            Repr::Int { value, scale } if scale >= 0 => positive_scale(value, scale),
            _ => None,
        }
    }

    /// `Quantity.Add`, or `Quantity.Sub` when `negate` (whose int64 path negates with wrapping).
    fn plus(self, other: Qty, negate: bool) -> Result<Qty, ExecutionError> {
        let overflow =
            || ExecutionError::function_error(if negate { "sub" } else { "add" }, "quantity overflow");
        let other_nanos = if negate {
            other.nanos.checked_neg().ok_or_else(overflow)?
        } else {
            other.nanos
        };
        let nanos = self.nanos.checked_add(other_nanos).ok_or_else(overflow)?;
        let int = match (self.repr, other.repr) {
            (Repr::Int { value: a, scale: sa }, Repr::Int { value: b, scale: sb }) => {
                int64_amount_add((a, sa), (if negate { b.wrapping_neg() } else { b }, sb))
            }
            _ => None,
        };
        let repr = match int {
            Some((value, scale)) => Repr::Int { value, scale },
            None => Repr::Dec {
                scale: self.dec_scale().max(other.dec_scale()),
            },
        };
        Ok(Qty { nanos, repr })
    }

    /// `Quantity.AsApproximateFloat64`: the unscaled integer times `math.Pow10` of the exponent.
    fn approximate_float(self) -> f64 {
        let (base, exponent) = match self.repr {
            Repr::Int { value, scale } => (value as f64, scale),
            Repr::Dec { scale } => {
                // At most 9 decimals: the value is a whole number of 10^-scale.
                let divisor = u32::try_from(9 - i64::from(scale))
                    .ok()
                    .and_then(|e| 10i128.checked_pow(e));
                (
                    divisor.map_or(0.0, |d| (self.nanos / d) as f64),
                    scale.saturating_neg(),
                )
            }
        };
        if exponent == 0 {
            base
        } else {
            base * go_pow10(exponent)
        }
    }
}

/// `value` × 10^scale in nano-units.
fn int_nanos(value: i64, scale: i32) -> Option<i128> {
    if value == 0 {
        return Some(0);
    }
    10i128
        .checked_pow(u32::try_from(scale.checked_add(9)?).ok()?)?
        .checked_mul(i128::from(value))
}

/// The exact value of `q`, read back from its canonical form (`Quantity` keeps it private).
fn exact_nanos(q: &Quantity) -> Option<i128> {
    let text = q.canonical();
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.as_str()),
    };
    let split = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    let (digits, suffix) = rest.split_at(split);
    let n: i128 = digits.parse().ok()?;
    let unit = match suffix {
        "" => NANO,
        "n" => 1,
        "u" => 1_000,
        "m" => 1_000_000,
        "k" => NANO * 1_000,
        "M" => NANO * 1_000_000,
        "G" => NANO * NANO,
        "T" => NANO * NANO * 1_000,
        "P" => NANO * NANO * 1_000_000,
        "E" => NANO * NANO * NANO,
        "Ki" => NANO << 10,
        "Mi" => NANO << 20,
        "Gi" => NANO << 30,
        "Ti" => NANO << 40,
        "Pi" => NANO << 50,
        "Ei" => NANO << 60,
        exponent => {
            let e: i64 = exponent.strip_prefix('e')?.parse().ok()?;
            10i128.checked_pow(u32::try_from(e.checked_add(9)?).ok()?)?
        }
    };
    let magnitude = n.checked_mul(unit)?;
    Some(if negative { -magnitude } else { magnitude })
}

/// apimachinery's `ParseQuantity` fast path: the int64 and scale it keeps a quantity as, or None
/// where it takes an `inf.Dec`. `text` is a valid quantity.
fn go_int64_amount(text: &str) -> Option<(i64, i32)> {
    let (positive, rest) = match text.as_bytes().first() {
        Some(b'-') => (false, &text[1..]),
        Some(b'+') => (true, &text[1..]),
        _ => (true, text),
    };
    let rest = rest.trim_start_matches('0');
    let digits = |s: &str| s.bytes().take_while(u8::is_ascii_digit).count();
    let (num, rest) = rest.split_at(digits(rest));
    let (denom, suffix) = match rest.strip_prefix('.') {
        Some(rest) => rest.split_at(digits(rest)),
        None => ("", rest),
    };
    let num = if num.is_empty() { "0" } else { num };
    let (binary, exponent) = suffix_exponent(suffix)?;
    let num_len = i64::try_from(num.len()).ok()?;
    let denom_len = i64::try_from(denom.len()).ok()?;
    let (mantissa, precision, scale) = if binary {
        if !denom.is_empty() {
            return None;
        }
        (1i64 << exponent, 14 - num_len - i64::from(exponent) * 3 / 10, 0)
    } else {
        (1, 18 - num_len - denom_len, i64::from(exponent))
    };
    let scale = scale - denom_len;
    if precision < 0 || scale < -9 {
        return None;
    }
    let value = num
        .bytes()
        .chain(denom.bytes())
        .try_fold(0i64, |v, d| v.checked_mul(10)?.checked_add(i64::from(d - b'0')))?;
    let value = value.checked_mul(mantissa)?;
    Some((if positive { value } else { -value }, i32::try_from(scale).ok()?))
}

/// apimachinery's suffixer: (binary, exponent of 2 or 10).
fn suffix_exponent(suffix: &str) -> Option<(bool, i32)> {
    let decimal = |e| Some((false, e));
    match suffix {
        "" => decimal(0),
        "n" => decimal(-9),
        "u" => decimal(-6),
        "m" => decimal(-3),
        "k" => decimal(3),
        "M" => decimal(6),
        "G" => decimal(9),
        "T" => decimal(12),
        "P" => decimal(15),
        "E" => decimal(18),
        "Ki" => Some((true, 10)),
        "Mi" => Some((true, 20)),
        "Gi" => Some((true, 30)),
        "Ti" => Some((true, 40)),
        "Pi" => Some((true, 50)),
        "Ei" => Some((true, 60)),
        _ => {
            let exponent = suffix.strip_prefix(['e', 'E']).filter(|e| !e.is_empty())?;
            decimal(i32::try_from(exponent.parse::<i64>().ok()?).ok()?)
        }
    }
}

/// `positiveScaleInt64`: `value` × 10^scale, None on overflow.
fn positive_scale(value: i64, scale: i32) -> Option<i64> {
    if value == 0 {
        return Some(0);
    }
    // Overflows within 19 steps.
    (0..scale).try_fold(value, |v, _| v.checked_mul(10))
}

/// `int64Amount.Add`: None when it would overflow (apimachinery then moves to `inf.Dec`).
fn int64_amount_add((a, sa): (i64, i32), (b, sb): (i64, i32)) -> Option<(i64, i32)> {
    match sa.cmp(&sb) {
        _ if b == 0 => Some((a, sa)),
        _ if a == 0 => Some((b, sb)),
        Ordering::Equal => Some((a.checked_add(b)?, sa)),
        Ordering::Greater => Some((positive_scale(a, sa.checked_sub(sb)?)?.checked_add(b)?, sb)),
        Ordering::Less => Some((a.checked_add(positive_scale(b, sb.checked_sub(sa)?)?)?, sa)),
    }
}

/// Go's `math.Pow10`, table for table, so that `asApproximateFloat` rounds as there.
fn go_pow10(n: i32) -> f64 {
    const TAB: [f64; 32] = [
        1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17,
        1e18, 1e19, 1e20, 1e21, 1e22, 1e23, 1e24, 1e25, 1e26, 1e27, 1e28, 1e29, 1e30, 1e31,
    ];
    const POS32: [f64; 10] = [1e0, 1e32, 1e64, 1e96, 1e128, 1e160, 1e192, 1e224, 1e256, 1e288];
    const NEG32: [f64; 11] = [
        1e-0, 1e-32, 1e-64, 1e-96, 1e-128, 1e-160, 1e-192, 1e-224, 1e-256, 1e-288, 1e-320,
    ];
    let m = n.unsigned_abs() as usize;
    match n {
        0..=308 => POS32[m / 32] * TAB[m % 32],
        -323..=-1 => NEG32[m / 32] / TAB[m % 32],
        _ if n > 0 => f64::INFINITY,
        _ => 0.0,
    }
}

fn quantity(text: &CelString<'_>) -> Result<Qty, ExecutionError> {
    Qty::parse(text.inner()).map_err(|e| ExecutionError::function_error("quantity", e))
}

fn is_quantity(text: &CelString<'_>) -> CelBool {
    CelBool::from(Quantity::parse(text.inner()).is_ok())
}

fn sign(q: &Qty) -> CelInt {
    CelInt::from(q.nanos.signum() as i64)
}

fn is_greater_than(a: &Qty, b: &Qty) -> CelBool {
    CelBool::from(a.nanos > b.nanos)
}

fn is_less_than(a: &Qty, b: &Qty) -> CelBool {
    CelBool::from(a.nanos < b.nanos)
}

fn compare_to(a: &Qty, b: &Qty) -> CelInt {
    CelInt::from(a.nanos.cmp(&b.nanos) as i64)
}

fn as_approximate_float(q: &Qty) -> CelDouble {
    CelDouble::from(q.approximate_float())
}

fn as_integer(q: &Qty) -> Result<CelInt, ExecutionError> {
    q.as_int64()
        .map(CelInt::from)
        .ok_or_else(|| ExecutionError::function_error("asInteger", "cannot convert value to integer"))
}

fn is_integer(q: &Qty) -> CelBool {
    CelBool::from(q.as_int64().is_some())
}

fn add(a: &Qty, b: &Qty) -> Result<Qty, ExecutionError> {
    a.plus(*b, false)
}

/// `resource.NewQuantity(i, DecimalExponent)`: an int64 at scale 0.
fn int_qty(i: &CelInt) -> Qty {
    let value = *i.inner();
    Qty {
        nanos: i128::from(value) * NANO,
        repr: Repr::Int { value, scale: 0 },
    }
}

fn add_int(a: &Qty, b: &CelInt) -> Result<Qty, ExecutionError> {
    a.plus(int_qty(b), false)
}

fn sub(a: &Qty, b: &Qty) -> Result<Qty, ExecutionError> {
    a.plus(*b, true)
}

fn sub_int(a: &Qty, b: &CelInt) -> Result<Qty, ExecutionError> {
    a.plus(int_qty(b), true)
}

// ---------------------------------------------------------------------------------------------
// kubernetes.Semver (apiserver/pkg/cel/semver.go, library/semverlib.go, blang/semver v4).

#[derive(Debug, Clone, PartialEq, Eq)]
enum Pre {
    Num(u64),
    Alpha(String),
}

/// A semantic version as blang/semver parses and orders it; build metadata is ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Semver {
    major: u64,
    minor: u64,
    patch: u64,
    pre: Vec<Pre>,
}

static SEMVER_TYPE: Type = Type::new_unspecified_type("kubernetes.Semver");

impl Val for Semver {
    fn get_type(&self) -> &Type {
        &SEMVER_TYPE
    }

    fn cel_type() -> &'static Type {
        &SEMVER_TYPE
    }

    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<Semver>()
            .is_some_and(|o| self.compare(o) == Ordering::Equal)
    }

    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

impl StaticVal for Semver {}

fn digits(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit())
}

/// blang/semver's `alphanum`: ASCII letters, digits and `-`.
fn alphanumeric(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A version number: digits, no leading zero.
fn number(s: &str, what: &str) -> Result<u64, String> {
    if !digits(s) {
        return Err(format!("Invalid character(s) found in {what} number {s:?}"));
    }
    if s.len() > 1 && s.starts_with('0') {
        return Err(format!(
            "{} number must not contain leading zeroes {s:?}",
            capitalized(what)
        ));
    }
    s.parse()
        .map_err(|e| format!("strconv.ParseUint: parsing {s:?}: {e}"))
}

fn capitalized(what: &str) -> String {
    let mut chars = what.chars();
    chars
        .next()
        .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
        .unwrap_or_default()
}

impl Semver {
    /// blang/semver's `Parse`, with its messages.
    fn parse(s: &str) -> Result<Semver, String> {
        if s.is_empty() {
            return Err("Version string empty".into());
        }
        let Some((major, (minor, rest))) =
            split_once(s, b'.').and_then(|(m, r)| Some((m, split_once(r, b'.')?)))
        else {
            return Err("No Major.Minor.Patch elements found".into());
        };
        let (major, minor) = (number(major, "major")?, number(minor, "minor")?);
        let (rest, build) = match split_once(rest, b'+') {
            Some((rest, build)) => (rest, Some(build)),
            None => (rest, None),
        };
        let (patch, pre) = match split_once(rest, b'-') {
            Some((patch, pre)) => (patch, Some(pre)),
            None => (rest, None),
        };
        let patch = number(patch, "patch")?;
        let mut version = Semver {
            major,
            minor,
            patch,
            pre: Vec::new(),
        };
        for p in pre.into_iter().flat_map(|pre| pre.split('.')) {
            version.pre.push(if p.is_empty() {
                return Err("Prerelease is empty".into());
            } else if digits(p) {
                if p.len() > 1 && p.starts_with('0') {
                    return Err(format!(
                        "Numeric PreRelease version must not contain leading zeroes {p:?}"
                    ));
                }
                Pre::Num(
                    p.parse()
                        .map_err(|e| format!("strconv.ParseUint: parsing {p:?}: {e}"))?,
                )
            } else if alphanumeric(p) {
                Pre::Alpha(p.to_string())
            } else {
                return Err(format!("Invalid character(s) found in prerelease {p:?}"));
            });
        }
        for b in build.into_iter().flat_map(|build| build.split('.')) {
            if b.is_empty() {
                return Err("Build meta data is empty".into());
            }
            if !alphanumeric(b) {
                return Err(format!("Invalid character(s) found in build meta data {b:?}"));
            }
        }
        Ok(version)
    }

    /// semverlib.go's `normalizeAndParse`: no `v` prefix, no leading zeros, missing parts 0.
    fn parse_normalized(s: &str) -> Result<Semver, String> {
        let s = s.strip_prefix('v').unwrap_or(s);
        let mut parts: Vec<String> = s
            .splitn(3, '.')
            .map(|p| {
                if p.len() <= 1 {
                    return p.to_string();
                }
                let trimmed = p.trim_start_matches('0');
                if trimmed.chars().next().is_some_and(|c| c.is_ascii_digit()) {
                    trimmed.to_string()
                } else {
                    format!("0{trimmed}")
                }
            })
            .collect();
        if parts.len() < 3 {
            if parts.last().is_some_and(|p| p.contains(['+', '-'])) {
                return Err("short version cannot contain PreRelease/Build meta data".into());
            }
            parts.resize(3, "0".into());
        }
        Semver::parse(&parts.join("."))
    }

    /// blang/semver's `Compare`.
    fn compare(&self, other: &Semver) -> Ordering {
        let release = (self.major, self.minor, self.patch).cmp(&(other.major, other.minor, other.patch));
        if release != Ordering::Equal {
            return release;
        }
        match (self.pre.is_empty(), other.pre.is_empty()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Greater,
            (false, true) => Ordering::Less,
            (false, false) => {
                for (a, b) in self.pre.iter().zip(&other.pre) {
                    let order = match (a, b) {
                        (Pre::Num(a), Pre::Num(b)) => a.cmp(b),
                        (Pre::Num(_), Pre::Alpha(_)) => Ordering::Less,
                        (Pre::Alpha(_), Pre::Num(_)) => Ordering::Greater,
                        (Pre::Alpha(a), Pre::Alpha(b)) => a.cmp(b),
                    };
                    if order != Ordering::Equal {
                        return order;
                    }
                }
                self.pre.len().cmp(&other.pre.len())
            }
        }
    }
}

fn semver(text: &CelString<'_>) -> Result<Semver, ExecutionError> {
    Semver::parse(text.inner()).map_err(|e| ExecutionError::function_error("semver", e))
}

fn semver_normalize(text: &CelString<'_>, normalize: &CelBool) -> Result<Semver, ExecutionError> {
    if *normalize.inner() {
        Semver::parse_normalized(text.inner()).map_err(|e| ExecutionError::function_error("semver", e))
    } else {
        semver(text)
    }
}

fn is_semver(text: &CelString<'_>) -> CelBool {
    CelBool::from(Semver::parse(text.inner()).is_ok())
}

fn is_semver_normalize(text: &CelString<'_>, normalize: &CelBool) -> CelBool {
    CelBool::from(semver_normalize(text, normalize).is_ok())
}

fn semver_is_greater_than(a: &Semver, b: &Semver) -> CelBool {
    CelBool::from(a.compare(b) == Ordering::Greater)
}

fn semver_is_less_than(a: &Semver, b: &Semver) -> CelBool {
    CelBool::from(a.compare(b) == Ordering::Less)
}

fn semver_compare_to(a: &Semver, b: &Semver) -> CelInt {
    CelInt::from(a.compare(b) as i64)
}

/// As semverlib.go, the uint64 read as an int64.
fn major(v: &Semver) -> CelInt {
    CelInt::from(v.major as i64)
}

fn minor(v: &Semver) -> CelInt {
    CelInt::from(v.minor as i64)
}

fn patch(v: &Semver) -> CelInt {
    CelInt::from(v.patch as i64)
}

// ---------------------------------------------------------------------------------------------
// The type check: cel-go's checker where the types are known, `dyn` elsewhere.

#[derive(Debug, Clone, PartialEq)]
enum Ty {
    /// Unknown: an attribute's value (`any`), or what this check does not infer.
    Dyn,
    Null,
    Bool,
    Int,
    Uint,
    Double,
    String,
    Bytes,
    Type,
    List(Box<Ty>),
    Map(Box<Ty>, Box<Ty>),
    Device,
    /// `device.attributes` or `device.capacity`.
    Domains(Of),
    /// One domain of them.
    Names(Of),
    Quantity,
    Semver,
}

impl Ty {
    fn name(&self) -> String {
        match self {
            Ty::Dyn => "dyn".into(),
            Ty::Null => "null_type".into(),
            Ty::Bool => "bool".into(),
            Ty::Int => "int".into(),
            Ty::Uint => "uint".into(),
            Ty::Double => "double".into(),
            Ty::String => "string".into(),
            Ty::Bytes => "bytes".into(),
            Ty::Type => "type".into(),
            Ty::List(t) => format!("list({})", t.name()),
            Ty::Map(k, v) => format!("map({}, {})", k.name(), v.name()),
            Ty::Device => "kubernetes.DRADevice".into(),
            Ty::Domains(Of::Attributes) => "map(string, map(string, any))".into(),
            Ty::Domains(Of::Capacity) => "map(string, map(string, kubernetes.Quantity))".into(),
            Ty::Names(Of::Attributes) => "map(string, any)".into(),
            Ty::Names(Of::Capacity) => "map(string, kubernetes.Quantity)".into(),
            Ty::Quantity => "kubernetes.Quantity".into(),
            Ty::Semver => "kubernetes.Semver".into(),
        }
    }

    fn is_map(&self) -> bool {
        matches!(self, Ty::Map(..) | Ty::Domains(_) | Ty::Names(_))
    }

    fn is_device_view(&self) -> bool {
        matches!(self, Ty::Device | Ty::Domains(_) | Ty::Names(_))
    }

    /// The key and value types of a map.
    fn map_types(&self) -> Option<(Ty, Ty)> {
        match self {
            Ty::Map(k, v) => Some(((**k).clone(), (**v).clone())),
            Ty::Domains(of) => Some((Ty::String, Ty::Names(*of))),
            Ty::Names(Of::Attributes) => Some((Ty::String, Ty::Dyn)),
            Ty::Names(Of::Capacity) => Some((Ty::String, Ty::Quantity)),
            _ => None,
        }
    }
}

/// Whether a value of one type may stand where the other is expected (type parameters unify):
/// `dyn` goes anywhere, lists and maps by their parameters.
fn compatible(a: &Ty, b: &Ty) -> bool {
    match (a, b) {
        (Ty::Dyn, _) | (_, Ty::Dyn) => true,
        (Ty::List(a), Ty::List(b)) => compatible(a, b),
        (a, b) if a.is_map() && b.is_map() => match (a.map_types(), b.map_types()) {
            (Some((ka, va)), Some((kb, vb))) => compatible(&ka, &kb) && compatible(&va, &vb),
            _ => true,
        },
        (a, b) => a == b,
    }
}

fn numeric(t: &Ty) -> bool {
    matches!(t, Ty::Int | Ty::Uint | Ty::Double)
}

/// A parameter of a function overload.
#[derive(Clone, Copy, PartialEq)]
enum P {
    Any,
    Bool,
    Int,
    Uint,
    Double,
    Str,
    Bytes,
    List,
    StrList,
    Map,
    Qty,
    Ver,
}

impl P {
    fn accepts(self, t: &Ty) -> bool {
        match (self, t) {
            (P::Any, _) | (_, Ty::Dyn) => true,
            (P::Bool, Ty::Bool) | (P::Int, Ty::Int) | (P::Uint, Ty::Uint) | (P::Double, Ty::Double) => true,
            (P::Str, Ty::String) | (P::Bytes, Ty::Bytes) | (P::Qty, Ty::Quantity) | (P::Ver, Ty::Semver) => {
                true
            }
            (P::List, Ty::List(_)) => true,
            (P::StrList, Ty::List(e)) => compatible(e, &Ty::String),
            (P::Map, t) => t.is_map(),
            _ => false,
        }
    }
}

/// The result of a function overload.
#[derive(Clone, Copy, PartialEq)]
enum R {
    Dyn,
    Bool,
    Int,
    Uint,
    Double,
    Str,
    Bytes,
    StrList,
    Type,
    Qty,
    Ver,
}

impl R {
    fn ty(self) -> Ty {
        match self {
            R::Dyn => Ty::Dyn,
            R::Bool => Ty::Bool,
            R::Int => Ty::Int,
            R::Uint => Ty::Uint,
            R::Double => Ty::Double,
            R::Str => Ty::String,
            R::Bytes => Ty::Bytes,
            R::StrList => Ty::List(Box::new(Ty::String)),
            R::Type => Ty::Type,
            R::Qty => Ty::Quantity,
            R::Ver => Ty::Semver,
        }
    }
}

/// (name, member, parameters with the receiver first, result): the functions evaluated here, each
/// as Kubernetes declares it (cel-go's standard library and strings extension version 2,
/// quantity.go, semverlib.go).
const OVERLOADS: &[(&str, bool, &[P], R)] = &[
    ("size", false, &[P::Str], R::Int),
    ("size", false, &[P::Bytes], R::Int),
    ("size", false, &[P::List], R::Int),
    ("size", false, &[P::Map], R::Int),
    ("size", true, &[P::Str], R::Int),
    ("size", true, &[P::Bytes], R::Int),
    ("size", true, &[P::List], R::Int),
    ("size", true, &[P::Map], R::Int),
    ("contains", true, &[P::Str, P::Str], R::Bool),
    ("startsWith", true, &[P::Str, P::Str], R::Bool),
    ("endsWith", true, &[P::Str, P::Str], R::Bool),
    ("matches", false, &[P::Str, P::Str], R::Bool),
    ("matches", true, &[P::Str, P::Str], R::Bool),
    ("int", false, &[P::Int], R::Int),
    ("int", false, &[P::Uint], R::Int),
    ("int", false, &[P::Double], R::Int),
    ("int", false, &[P::Str], R::Int),
    ("uint", false, &[P::Int], R::Uint),
    ("uint", false, &[P::Uint], R::Uint),
    ("uint", false, &[P::Double], R::Uint),
    ("uint", false, &[P::Str], R::Uint),
    ("double", false, &[P::Int], R::Double),
    ("double", false, &[P::Uint], R::Double),
    ("double", false, &[P::Double], R::Double),
    ("double", false, &[P::Str], R::Double),
    ("string", false, &[P::Str], R::Str),
    ("string", false, &[P::Bool], R::Str),
    ("string", false, &[P::Int], R::Str),
    ("string", false, &[P::Uint], R::Str),
    ("string", false, &[P::Double], R::Str),
    ("string", false, &[P::Bytes], R::Str),
    ("bytes", false, &[P::Str], R::Bytes),
    ("bytes", false, &[P::Bytes], R::Bytes),
    ("bool", false, &[P::Bool], R::Bool),
    ("bool", false, &[P::Str], R::Bool),
    ("dyn", false, &[P::Any], R::Dyn),
    ("type", false, &[P::Any], R::Type),
    ("charAt", true, &[P::Str, P::Int], R::Str),
    ("indexOf", true, &[P::Str, P::Str], R::Int),
    ("indexOf", true, &[P::Str, P::Str, P::Int], R::Int),
    ("lastIndexOf", true, &[P::Str, P::Str], R::Int),
    ("lastIndexOf", true, &[P::Str, P::Str, P::Int], R::Int),
    ("lowerAscii", true, &[P::Str], R::Str),
    ("upperAscii", true, &[P::Str], R::Str),
    ("trim", true, &[P::Str], R::Str),
    ("replace", true, &[P::Str, P::Str, P::Str], R::Str),
    ("replace", true, &[P::Str, P::Str, P::Str, P::Int], R::Str),
    ("split", true, &[P::Str, P::Str], R::StrList),
    ("split", true, &[P::Str, P::Str, P::Int], R::StrList),
    ("substring", true, &[P::Str, P::Int], R::Str),
    ("substring", true, &[P::Str, P::Int, P::Int], R::Str),
    ("join", true, &[P::StrList], R::Str),
    ("join", true, &[P::StrList, P::Str], R::Str),
    ("quantity", false, &[P::Str], R::Qty),
    ("isQuantity", false, &[P::Str], R::Bool),
    ("sign", false, &[P::Qty], R::Int),
    ("isGreaterThan", true, &[P::Qty, P::Qty], R::Bool),
    ("isGreaterThan", true, &[P::Ver, P::Ver], R::Bool),
    ("isLessThan", true, &[P::Qty, P::Qty], R::Bool),
    ("isLessThan", true, &[P::Ver, P::Ver], R::Bool),
    ("compareTo", true, &[P::Qty, P::Qty], R::Int),
    ("compareTo", true, &[P::Ver, P::Ver], R::Int),
    ("asApproximateFloat", true, &[P::Qty], R::Double),
    ("asInteger", true, &[P::Qty], R::Int),
    ("isInteger", true, &[P::Qty], R::Bool),
    ("add", true, &[P::Qty, P::Qty], R::Qty),
    ("add", true, &[P::Qty, P::Int], R::Qty),
    ("sub", true, &[P::Qty, P::Qty], R::Qty),
    ("sub", true, &[P::Qty, P::Int], R::Qty),
    ("semver", false, &[P::Str], R::Ver),
    ("semver", false, &[P::Str, P::Bool], R::Ver),
    ("isSemver", false, &[P::Str], R::Bool),
    ("isSemver", false, &[P::Str, P::Bool], R::Bool),
    ("major", true, &[P::Ver], R::Int),
    ("minor", true, &[P::Ver], R::Int),
    ("patch", true, &[P::Ver], R::Int),
];

/// Functions Kubernetes also declares for types not listed in [`OVERLOADS`] (its lists library's
/// `indexOf` on lists): a call none of the listed ones accepts may still be valid there.
const PARTIAL: &[&str] = &["indexOf", "lastIndexOf"];

struct Checker<'e> {
    env: &'e Env,
    /// Comprehension and `cel.bind` variables, innermost last.
    scopes: Vec<(String, Ty)>,
    /// The first construct not evaluated here.
    unsupported: Option<String>,
}

/// A type, or cel-go's compile error.
type Checked = Result<Ty, String>;

/// cel-go's message: `'(a, b)'`, or `'a.(b)'` for a member call on `a`.
fn no_overload(function: &str, member: bool, args: &[&Ty]) -> String {
    let names: Vec<String> = args.iter().map(|t| t.name()).collect();
    let applied = match names.split_first() {
        Some((target, rest)) if member => format!("{target}.({})", rest.join(", ")),
        _ => format!("({})", names.join(", ")),
    };
    format!("found no matching overload for '{function}' applied to '{applied}'")
}

impl Checker<'_> {
    fn unsupported(&mut self, what: impl Into<String>) -> Ty {
        self.unsupported.get_or_insert_with(|| what.into());
        Ty::Dyn
    }

    fn check(&mut self, e: &IdedExpr) -> Checked {
        match &e.expr {
            Expr::Literal(literal) => Ok(match literal {
                LiteralValue::Boolean(_) => Ty::Bool,
                LiteralValue::Bytes(_) => Ty::Bytes,
                LiteralValue::Double(_) => Ty::Double,
                LiteralValue::Int(_) => Ty::Int,
                LiteralValue::Null => Ty::Null,
                LiteralValue::String(_) => Ty::String,
                LiteralValue::UInt(_) => Ty::Uint,
            }),
            Expr::Ident(name) => self.ident(name),
            Expr::Select(select) => {
                let operand = self.check(&select.operand)?;
                let field = self.field(&operand, &select.field)?;
                Ok(if select.test { Ty::Bool } else { field })
            }
            Expr::Call(call) => self.call(call),
            Expr::List(list) => {
                if !list.optional_indices.is_empty() {
                    return Ok(self.unsupported("optional list elements"));
                }
                let element = self.homogeneous(list.elements.iter())?;
                Ok(Ty::List(Box::new(element)))
            }
            Expr::Map(map) => {
                let (mut keys, mut values) = (Vec::new(), Vec::new());
                for entry in &map.entries {
                    match &entry.expr {
                        EntryExpr::MapEntry(entry) if !entry.optional => {
                            keys.push(&entry.key);
                            values.push(&entry.value);
                        }
                        _ => return Ok(self.unsupported("optional map entries")),
                    }
                }
                let key = self.homogeneous(keys.into_iter())?;
                if !matches!(key, Ty::Dyn | Ty::Bool | Ty::Int | Ty::Uint | Ty::String) {
                    return Err(format!("unsupported map key type: {}", key.name()));
                }
                let value = self.homogeneous(values.into_iter())?;
                Ok(Ty::Map(Box::new(key), Box::new(value)))
            }
            Expr::Struct(_) => Ok(self.unsupported("message literals")),
            Expr::Comprehension(c) => self.comprehension(c),
            Expr::Unspecified => Err("invalid expression".into()),
        }
    }

    /// The element type of a list or map literal: all of one type (`HomogeneousAggregateLiterals`).
    fn homogeneous<'x>(&mut self, items: impl std::iter::Iterator<Item = &'x IdedExpr>) -> Checked {
        let mut found = Ty::Dyn;
        for item in items {
            let t = self.check(item)?;
            if found == Ty::Dyn {
                found = t;
            } else if !compatible(&found, &t) {
                return Err(format!(
                    "expected type '{}' but found '{}'",
                    found.name(),
                    t.name()
                ));
            }
        }
        Ok(found)
    }

    fn ident(&mut self, name: &str) -> Checked {
        if let Some((_, t)) = self.scopes.iter().rev().find(|(n, _)| n == name) {
            return Ok(t.clone());
        }
        match name {
            "device" => Ok(Ty::Device),
            "bool" | "int" | "uint" | "double" | "string" | "bytes" | "list" | "map" | "null_type"
            | "type" => Ok(Ty::Type),
            "dyn" | "optional_type" | "google" | "kubernetes" => {
                Ok(self.unsupported(format!("the name '{name}'")))
            }
            _ => Err(format!("undeclared reference to '{name}' (in container '')")),
        }
    }

    fn field(&mut self, operand: &Ty, field: &str) -> Checked {
        match operand {
            Ty::Dyn => Ok(Ty::Dyn),
            Ty::Device => match field {
                "driver" => Ok(Ty::String),
                "attributes" => Ok(Ty::Domains(Of::Attributes)),
                "capacity" => Ok(Ty::Domains(Of::Capacity)),
                "allowMultipleAllocations" => Ok(Ty::Bool),
                _ => Err(format!("undefined field '{field}'")),
            },
            t => match t.map_types() {
                Some((key, value)) if compatible(&key, &Ty::String) => Ok(value),
                _ => Err(format!("type '{}' does not support field selection", t.name())),
            },
        }
    }

    /// The name `a.b.f` a call `a.b.f(..)` spells when `a` is no variable: a namespaced function.
    fn namespaced(&self, target: &IdedExpr, function: &str) -> Option<String> {
        let mut segments = vec![function];
        let mut e = target;
        loop {
            match &e.expr {
                Expr::Select(s) if !s.test => {
                    segments.push(&s.field);
                    e = &s.operand;
                }
                Expr::Ident(root) => {
                    let declared = root == "device" || self.scopes.iter().any(|(n, _)| n == root);
                    segments.push(root);
                    segments.reverse();
                    return (!declared).then(|| segments.join("."));
                }
                _ => return None,
            }
        }
    }

    fn call(&mut self, call: &CallExpr) -> Checked {
        let name = call.func_name.as_str();
        if let Some(target) = &call.target
            && let Some(qualified) = self.namespaced(target, name)
        {
            for arg in &call.args {
                self.check(arg)?;
            }
            return Ok(self.unsupported(format!("the function '{qualified}'")));
        }
        let target = match &call.target {
            Some(t) => Some(self.check(t)?),
            None => None,
        };
        let mut args = Vec::with_capacity(call.args.len());
        for arg in &call.args {
            args.push(self.check(arg)?);
        }
        if target.is_none()
            && let Some(t) = self.operator(name, &args)?
        {
            return Ok(t);
        }
        self.function(name, target, &args, &call.args)
    }

    /// The operators; None for any other function.
    fn operator(&mut self, name: &str, args: &[Ty]) -> Result<Option<Ty>, String> {
        let t = match (name, args) {
            ("_&&_" | "_||_", [a, b]) => {
                if !matches!(a, Ty::Bool | Ty::Dyn) || !matches!(b, Ty::Bool | Ty::Dyn) {
                    return Err(no_overload(name, false, &[a, b]));
                }
                Ty::Bool
            }
            ("!_", [a]) | ("@not_strictly_false", [a]) => {
                if !matches!(a, Ty::Bool | Ty::Dyn) {
                    return Err(no_overload(name, false, &[a]));
                }
                Ty::Bool
            }
            ("_?_:_", [c, a, b]) => {
                if !matches!(c, Ty::Bool | Ty::Dyn) || !compatible(a, b) {
                    return Err(no_overload(name, false, &[c, a, b]));
                }
                if a == b { a.clone() } else { Ty::Dyn }
            }
            ("_==_" | "_!=_", [a, b]) => {
                if a.is_device_view() || b.is_device_view() {
                    return Ok(Some(self.unsupported(format!("'{name}' on device or its maps"))));
                }
                if !compatible(a, b) {
                    return Err(no_overload(name, false, &[a, b]));
                }
                Ty::Bool
            }
            ("_<_" | "_<=_" | "_>_" | "_>=_", [a, b]) => {
                let ordered = |t: &Ty| matches!(t, Ty::Bool | Ty::String | Ty::Bytes) || numeric(t);
                let ok = match (a, b) {
                    (Ty::Dyn, t) | (t, Ty::Dyn) => ordered(t) || *t == Ty::Dyn,
                    (a, b) => (numeric(a) && numeric(b)) || (ordered(a) && a == b),
                };
                if !ok {
                    return Err(no_overload(name, false, &[a, b]));
                }
                Ty::Bool
            }
            ("_+_" | "_-_" | "_*_" | "_/_" | "_%_", [a, b]) => {
                let allowed = |t: &Ty| match name {
                    "_+_" => matches!(
                        t,
                        Ty::Int | Ty::Uint | Ty::Double | Ty::String | Ty::Bytes | Ty::List(_)
                    ),
                    "_%_" => matches!(t, Ty::Int | Ty::Uint),
                    _ => numeric(t),
                };
                match (a, b) {
                    (Ty::Dyn, Ty::Dyn) => Ty::Dyn,
                    (Ty::Dyn, t) | (t, Ty::Dyn) if allowed(t) => t.clone(),
                    (Ty::List(x), Ty::List(y)) if name == "_+_" => {
                        Ty::List(Box::new(if x == y { (**x).clone() } else { Ty::Dyn }))
                    }
                    (a, b) if a == b && allowed(a) => a.clone(),
                    _ => return Err(no_overload(name, false, &[a, b])),
                }
            }
            ("-_", [a]) => match a {
                Ty::Dyn | Ty::Int | Ty::Double => a.clone(),
                _ => return Err(no_overload(name, false, &[a])),
            },
            ("_[_]", [a, i]) => match a {
                Ty::Dyn => Ty::Dyn,
                Ty::List(element) if matches!(i, Ty::Dyn | Ty::Int | Ty::Uint | Ty::Double) => {
                    (**element).clone()
                }
                t => match t.map_types() {
                    Some((key, value)) if compatible(&key, i) => value,
                    _ => return Err(no_overload(name, false, &[a, i])),
                },
            },
            ("@in", [a, b]) => {
                if a.is_device_view() {
                    return Ok(Some(self.unsupported("'in' on device or its maps")));
                }
                let ok = match b {
                    Ty::Dyn => true,
                    Ty::List(element) => compatible(a, element),
                    t => t.map_types().is_some_and(|(key, _)| compatible(a, &key)),
                };
                if !ok {
                    return Err(no_overload(name, false, &[a, b]));
                }
                Ty::Bool
            }
            ("_?._" | "_[?_]", _) => self.unsupported("optional values"),
            _ => return Ok(None),
        };
        Ok(Some(t))
    }

    fn function(&mut self, name: &str, target: Option<Ty>, args: &[Ty], exprs: &[IdedExpr]) -> Checked {
        let member = target.is_some();
        let all: Vec<&Ty> = target.iter().chain(args).collect();
        let mut known = false;
        let mut result: Option<Ty> = None;
        for (n, m, params, r) in OVERLOADS {
            if *n != name {
                continue;
            }
            known = true;
            if *m != member
                || params.len() != all.len()
                || !params.iter().zip(&all).all(|(p, t)| p.accepts(t))
            {
                continue;
            }
            let t = r.ty();
            result = Some(match result {
                Some(previous) if previous != t => Ty::Dyn,
                _ => t,
            });
        }
        match result {
            Some(t) => {
                if name == "matches" {
                    self.regex_literal(if member { exprs.first() } else { exprs.get(1) })?;
                }
                Ok(t)
            }
            None if known && !PARTIAL.contains(&name) => Err(no_overload(name, member, &all)),
            None => Ok(self.unsupported(format!("the function '{name}'"))),
        }
    }

    /// cel-go's `ValidateRegexLiterals`: a literal pattern must compile.
    fn regex_literal(&self, pattern: Option<&IdedExpr>) -> Result<(), String> {
        let Some(Expr::Literal(LiteralValue::String(pattern))) = pattern.map(|p| &p.expr) else {
            return Ok(());
        };
        let args = vec![
            CowVal::owned(CelString::from("")),
            CowVal::Borrowed(pattern as &dyn Val),
        ];
        match self
            .env
            .find_overload("matches", &args)
            .map(|matches| matches(args))
        {
            Some(Err(e)) => Err(e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")),
            _ => Ok(()),
        }
    }

    fn comprehension(&mut self, c: &ComprehensionExpr) -> Checked {
        let range = self.check(&c.iter_range)?;
        let (first, second) = match &range {
            Ty::Dyn => (Ty::Dyn, Ty::Dyn),
            Ty::List(element) => (Ty::Int, (**element).clone()),
            t => match t.map_types() {
                Some(kv) => kv,
                None => {
                    return Err(format!(
                        "expression of type '{}' cannot be range of a comprehension (must be list, map, or dynamic)",
                        t.name()
                    ));
                }
            },
        };
        let (iter, iter2) = match (&range, &c.iter_var2) {
            (Ty::List(_), None) => (second, None),
            (_, None) => (first, None),
            (_, Some(_)) => (first, Some(second)),
        };
        let accu = self.check(&c.accu_init)?;
        let depth = self.scopes.len();
        self.scopes.push((c.accu_var.clone(), accu));
        self.scopes.push((c.iter_var.clone(), iter));
        if let (Some(name), Some(t)) = (&c.iter_var2, iter2) {
            self.scopes.push((name.clone(), t));
        }
        let body = self.check(&c.loop_cond).and_then(|_| self.check(&c.loop_step));
        self.scopes.truncate(depth + 1);
        let result = body.and_then(|_| self.check(&c.result));
        self.scopes.truncate(depth);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::slice::{MEMORY_CAPACITY, PCIE_ROOT_ATTRIBUTE};
    use crate::plugin::proto::DRA_DRIVER_NAME;
    use k8s_openapi::api::resource::v1::DeviceCapacity;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;

    fn int(i: i64) -> DeviceAttribute {
        DeviceAttribute {
            int: Some(i),
            ..Default::default()
        }
    }

    fn string(s: &str) -> DeviceAttribute {
        DeviceAttribute {
            string: Some(s.into()),
            ..Default::default()
        }
    }

    fn version(v: &str) -> DeviceAttribute {
        DeviceAttribute {
            version: Some(v.into()),
            ..Default::default()
        }
    }

    /// A T4 as the agent publishes it (node::slice's `gpu_device`).
    fn t4() -> Device {
        let attributes = BTreeMap::from([
            ("index".to_string(), int(0)),
            (
                "uuid".to_string(),
                string("GPU-5d1b3f49-0c1a-8e2b-7b9c-2f1a9e6d4c10"),
            ),
            ("productName".to_string(), string("Tesla T4")),
            ("memoryMiB".to_string(), int(15360)),
            ("computeCapability".to_string(), version("7.5.0")),
            ("architecture".to_string(), string("Turing")),
            ("driverVersion".to_string(), version("535.104.5")),
            ("cudaDriverVersion".to_string(), version("12.2.0")),
            ("pciBusID".to_string(), string("0000:3b:00.0")),
            (PCIE_ROOT_ATTRIBUTE.to_string(), string("pci0000:3a")),
            ("numaNode".to_string(), int(0)),
            ("pcieSwitch".to_string(), int(1)),
            ("nvlinkPeers".to_string(), int(0)),
        ]);
        let memory = DeviceCapacity {
            value: K8sQuantity("15Gi".into()),
            request_policy: None,
        };
        Device {
            name: "gpu-0".into(),
            allow_multiple_allocations: Some(true),
            attributes: Some(attributes),
            capacity: Some(BTreeMap::from([(MEMORY_CAPACITY.to_string(), memory)])),
            ..Default::default()
        }
    }

    /// What kube-scheduler makes of a selector for a device.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Got {
        True,
        False,
        /// `CEL runtime error`.
        Runtime,
        /// `CEL compile error`.
        Compile,
        /// Valid there, not evaluated here.
        Unsupported,
    }
    use Got::{Compile, False, Runtime, True, Unsupported};

    fn outcome(expression: &str, device: &Device) -> Got {
        let result = Selector::compile(expression).and_then(|s| s.matches(DRA_DRIVER_NAME, device));
        match result {
            Ok(true) => True,
            Ok(false) => False,
            Err(SelectorError::Runtime(_)) => Runtime,
            Err(SelectorError::Compile(_)) => Compile,
            Err(SelectorError::Unsupported(_)) => Unsupported,
        }
    }

    fn check_table(rows: &[(&str, Got)], device: &Device) {
        let wrong: Vec<String> = rows
            .iter()
            .filter_map(|&(expression, want)| {
                let got = outcome(expression, device);
                (got != want).then(|| format!("{expression}: want {want:?}, got {got:?}"))
            })
            .collect();
        assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    }

    /// Sources: compile.go (newCompiler, DeviceMatches, parseQualifiedName,
    /// newStringInterfaceMapWithDefault), environment/base.go, library/quantity.go,
    /// library/semverlib.go, and cel-go's checker and interpreter semantics they configure.
    #[test]
    fn selectors_on_a_t4_as_kube_scheduler_evaluates_them() {
        let rows = [
            // compile.go: `driver` is the slice's driver.
            (r#"device.driver == "gpumem.io""#, True),
            (r#"device.driver == "nvidia.com""#, False),
            // parseQualifiedName: an unqualified name is in the driver's domain.
            (
                r#"device.attributes["gpumem.io"].productName == "Tesla T4""#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].productName in ["Tesla T4", "Tesla V100-SXM2-32GB"]"#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].productName.startsWith("Tesla")"#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].productName.endsWith("A100")"#,
                False,
            ),
            // base.go: strings extension version 2 (lowerAscii), standard `matches` and `size`.
            (
                r#"device.attributes["gpumem.io"].productName.lowerAscii().contains("t4")"#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].productName.matches("^Tesla (T4|V100)$")"#,
                True,
            ),
            (r#"device.attributes["gpumem.io"].productName.size() == 8"#, True),
            // An int attribute against int literals; cross-type numeric comparison (base.go)
            // and heterogeneous equality at runtime.
            (r#"device.attributes["gpumem.io"].memoryMiB >= 15000"#, True),
            (r#"device.attributes["gpumem.io"].memoryMiB > 16000"#, False),
            (r#"device.attributes["gpumem.io"].memoryMiB >= 15000.5"#, True),
            (r#"device.attributes["gpumem.io"].memoryMiB == 15360.0"#, True),
            (r#"device.attributes["gpumem.io"].index in [0, 1]"#, True),
            // Capacity is a quantity (library/quantity.go); 15Gi is above 16G (decimal).
            (
                r#"device.capacity["gpumem.io"].memory.compareTo(quantity("15Gi")) >= 0"#,
                True,
            ),
            (
                r#"device.capacity["gpumem.io"].memory.isGreaterThan(quantity("16G"))"#,
                True,
            ),
            (
                r#"device.capacity["gpumem.io"].memory.isLessThan(quantity("40Gi"))"#,
                True,
            ),
            (
                r#"device.capacity["gpumem.io"].memory == quantity("15360Mi")"#,
                True,
            ),
            (
                r#"device.capacity["gpumem.io"].memory.asInteger() == 16106127360"#,
                True,
            ),
            (
                r#"device.capacity["gpumem.io"].memory.add(quantity("1Gi")).compareTo(quantity("16Gi")) == 0"#,
                True,
            ),
            // quantity.go declares `sign` with cel.Overload: a global function, not a method.
            (r#"sign(device.capacity["gpumem.io"].memory) == 1"#, True),
            (r#"device.capacity["gpumem.io"].memory.sign() == 1"#, Compile),
            // Quantities have no `<` (no such overload in the checker) and equal only quantities.
            (
                r#"device.capacity["gpumem.io"].memory > quantity("1Gi")"#,
                Compile,
            ),
            (r#"device.capacity["gpumem.io"].memory == 16106127360"#, Compile),
            // Version attributes are semvers (semverlib.go).
            (
                r#"device.attributes["gpumem.io"].computeCapability.isGreaterThan(semver("7.0.0"))"#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].computeCapability.compareTo(semver("8.0.0")) < 0"#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].computeCapability == semver("7.5.0")"#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].computeCapability.major() == 7 && device.attributes["gpumem.io"].computeCapability.minor() == 5"#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].driverVersion.isLessThan(semver("550.0.0"))"#,
                True,
            ),
            // semver() of a string that is not a full semver fails when evaluated.
            (
                r#"device.attributes["gpumem.io"].computeCapability.isGreaterThan(semver("7.0"))"#,
                Runtime,
            ),
            // An `any` receiver type-checks against the quantity overload; the value is a semver.
            (
                r#"device.attributes["gpumem.io"].computeCapability.isGreaterThan(quantity("7"))"#,
                Runtime,
            ),
            // parseQualifiedName: a qualified name is in its own domain only.
            (
                r#"device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:3a""#,
                True,
            ),
            (
                r#"device.attributes["gpumem.io"].pcieRoot == "pci0000:3a""#,
                Runtime,
            ),
            // newStringInterfaceMapWithDefault: an unknown domain is an empty map; a missing name
            // in it, or in a known domain, is "no such key".
            (r#"device.attributes["other.io"].x == 1"#, Runtime),
            (r#"device.attributes["gpumem.io"].missing == 1"#, Runtime),
            (
                r#"device.capacity["gpumem.io"].missing.isGreaterThan(quantity("1"))"#,
                Runtime,
            ),
            (r#"device.capacity["other.io"].size() == 0"#, True),
            // has() and `in` test presence instead.
            (r#"has(device.attributes["gpumem.io"].numaNode)"#, True),
            (r#"has(device.attributes["gpumem.io"].missing)"#, False),
            (r#"has(device.attributes["other.io"].x)"#, False),
            (r#""productName" in device.attributes["gpumem.io"]"#, True),
            (
                r#""gpumem.io" in device.attributes && !("other.io" in device.attributes)"#,
                True,
            ),
            // Maps iterate and count their keys.
            (
                r#"device.attributes["gpumem.io"].exists(name, name == "uuid")"#,
                True,
            ),
            (
                r#"size(device.attributes["gpumem.io"]) == 12 && size(device.attributes) == 2"#,
                True,
            ),
            (
                r#"device.attributes.all(d, d == "gpumem.io" || d == "resource.kubernetes.io")"#,
                True,
            ),
            // Commutative && and ||: an error on one side is absorbed by the other's result.
            (r#"device.attributes["gpumem.io"].missing == 1 || true"#, True),
            (r#"device.attributes["gpumem.io"].missing == 1 && false"#, False),
            // Attributes are `any`: comparing a string to an int compiles; equality is false at
            // runtime, ordering has no overload.
            (r#"device.attributes["gpumem.io"].productName == 4"#, False),
            (r#"device.attributes["gpumem.io"].productName > 4"#, Runtime),
            (r#"int(device.attributes["gpumem.io"].pciBusID) == 0"#, Runtime),
            // Known types are checked when compiling (cel-go's checker).
            (r#"device.driver == 1"#, Compile),
            (r#"1 == 1.0"#, Compile),
            (r#"device.foo == 1"#, Compile),
            (r#"gpu.memory > 1"#, Compile),
            (r#"true || undeclared"#, Compile),
            (r#"[1, "a"].size() == 2"#, Compile),
            (r#"device.driver.startsWith(1)"#, Compile),
            // base.go: regex literals are checked when compiling (ValidateRegexLiterals).
            (
                r#"device.attributes["gpumem.io"].productName.matches("(")"#,
                Compile,
            ),
            // CompileCELExpression: the result must be bool or `any`; an `any` that is not a bool
            // fails in DeviceMatches.
            (r#"device.attributes["gpumem.io"].memoryMiB"#, Runtime),
            (r#"device.driver"#, Compile),
            (r#"device.attributes["gpumem.io"]"#, Compile),
            (r#"1 + 1"#, Compile),
            // Syntax errors.
            (r#"device.attributes["gpumem.io"].productName =="#, Compile),
            (r#"device.attributes["gpumem.io".productName"#, Compile),
            // cel.bind (ext.Bindings, enabled in newCompiler).
            (
                r#"cel.bind(g, device.attributes["gpumem.io"], g.memoryMiB >= 15000 && g.architecture == "Turing")"#,
                True,
            ),
            // allowMultipleAllocations: declared with DRAConsumableCapacity, on by default in 1.36.
            (r#"device.allowMultipleAllocations"#, True),
            // Kubernetes has these; this evaluator does not.
            (
                r#"device.attributes["gpumem.io"].?numaNode.orValue(1) == 0"#,
                Unsupported,
            ),
            (r#"optional.of(1).hasValue()"#, Unsupported),
            (
                r#"device.attributes["gpumem.io"].productName.reverse() == "4T alseT""#,
                Unsupported,
            ),
            (r#"sets.contains([1, 2], [1])"#, Unsupported),
            (r#"device.attributes["gpumem.io"] == {}"#, Unsupported),
        ];
        assert!(rows.len() >= 30);
        check_table(&rows, &t4());
    }

    /// The expectations of Kubernetes' own tests of its CEL libraries: library/quantity_test.go
    /// and library/semver_test.go (values written as comparisons).
    #[test]
    fn quantity_and_semver_libraries_as_kubernetes_tests_them() {
        let rows = [
            (r#"quantity("12Mi") == quantity("12582912")"#, True),
            (r#"quantity("10Mo") == quantity("1")"#, Runtime),
            (r#"quantity("10Mm") == quantity("1")"#, Runtime),
            (
                r#"isQuantity("20") && isQuantity("20M") && isQuantity("20Mi")"#,
                True,
            ),
            (r#"isQuantity("20Mo") || isQuantity("10Mm")"#, False),
            (r#"isQuantity([1, 2, 3])"#, Compile),
            (
                r#"quantity("200M") == quantity("0.2G") && quantity("0.2G") == quantity("200M")"#,
                True,
            ),
            (
                r#"quantity("2M") == quantity("0.002G") && quantity("2000k") == quantity("2M") && quantity("0.002G") == quantity("2000k")"#,
                True,
            ),
            (r#"quantity("200M") == quantity("0.3G")"#, False),
            (r#"quantity("50M").isLessThan(quantity("50Mi"))"#, True),
            (r#"quantity("100M").isLessThan(quantity("50M"))"#, False),
            (r#"quantity("50Mi").isGreaterThan(quantity("50M"))"#, True),
            (r#"quantity("200M").compareTo(quantity("0.2G")) == 0"#, True),
            (r#"quantity("50M").compareTo(quantity("50Mi")) == -1"#, True),
            (
                r#"quantity("50k").add(quantity("20")) == quantity("50.02k")"#,
                True,
            ),
            (r#"quantity("50k").add(20).isLessThan(quantity("50020"))"#, False),
            (
                r#"quantity("50k").sub(quantity("20")) == quantity("49.98k")"#,
                True,
            ),
            (r#"quantity("50k").sub(20) == quantity("49980")"#, True),
            (
                r#"quantity("50k").add(20).sub(quantity("100k")).asInteger() == -49980"#,
                True,
            ),
            (
                r#"quantity("50k").add(20).sub(quantity("100k")).sub(-50000).asInteger() == 20"#,
                True,
            ),
            (r#"quantity("50k").asInteger() == 50000"#, True),
            (r#"quantity("50").isInteger()"#, True),
            (r#"quantity("50.703k").asApproximateFloat() == 50703.0"#, True),
            // apimachinery's representation: int64 with a negative scale, or inf.Dec, is no
            // integer for AsInt64 (amount.go, quantity.go).
            (
                r#"quantity("2000m").isInteger() || quantity("1.5Gi").isInteger()"#,
                False,
            ),
            (
                r#"quantity("2k").isInteger() && quantity("1.5Gi") == quantity("1536Mi")"#,
                True,
            ),
            (r#"quantity("1.5Gi").asInteger() == 1610612736"#, Runtime),
            (r#"isSemver("1.2.3-beta.1+build.1")"#, True),
            (r#"semver("v1.0") == semver("1.0.0")"#, Runtime),
            (
                r#"isSemver("") || isSemver("v1.0.0") || isSemver(" 1.0.0") || isSemver("1. 0.0") || isSemver("1.0.0 ") || isSemver("01.01.01") || isSemver("1") || isSemver("1.1")"#,
                False,
            ),
            (
                r#"isSemver("", true) || isSemver(" 1.0.0", true) || isSemver("1. 0.0", true) || isSemver("1.0.0 ", true)"#,
                False,
            ),
            (
                r#"isSemver("v1.0.0", true) && isSemver("01.01.01", true) && isSemver("1", true) && isSemver("1.1", true)"#,
                True,
            ),
            (r#"isSemver([1, 2, 3])"#, Compile),
            (r#"semver("v01.01", true) == semver("1.1.0")"#, True),
            (r#"semver("1.2.3") == semver("1.0.0")"#, False),
            (
                r#"semver("1.0.0").isLessThan(semver("1.2.3")) && !semver("1.0.0").isLessThan(semver("1.0.0"))"#,
                True,
            ),
            (
                r#"semver("1.2.3").isGreaterThan(semver("1.0.0")) && !semver("1.0.0").isGreaterThan(semver("1.0.0"))"#,
                True,
            ),
            (
                r#"semver("1.0.0").compareTo(semver("1.2.3")) == -1 && semver("1.2.3").compareTo(semver("1.0.0")) == 1"#,
                True,
            ),
            (
                r#"semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && semver("1.2.3").patch() == 3"#,
                True,
            ),
            // blang/semver: a pre-release orders before its release, numeric before alphanumeric
            // identifiers; build metadata is ignored.
            (
                r#"semver("1.0.0-rc.1").isLessThan(semver("1.0.0")) && semver("1.0.0-1").isLessThan(semver("1.0.0-alpha"))"#,
                True,
            ),
            (
                r#"semver("1.0.0-alpha").isLessThan(semver("1.0.0-alpha.1")) && semver("1.0.0+a") == semver("1.0.0+b")"#,
                True,
            ),
        ];
        check_table(&rows, &t4());
    }

    /// compile.go, DeviceMatches: every attribute is converted before evaluating, so a device
    /// with one kube-scheduler cannot convert fails any selector, even one that does not read it.
    #[test]
    fn a_device_with_an_unconvertible_attribute_fails_every_selector() {
        let broken = [
            ("empty", DeviceAttribute::default()),
            (
                "list",
                DeviceAttribute {
                    ints: Some(vec![1, 2]),
                    ..Default::default()
                },
            ),
            ("badVersion", version("7.5")),
        ];
        for (name, attribute) in broken {
            let mut device = t4();
            device
                .attributes
                .get_or_insert_default()
                .insert(name.into(), attribute);
            for expression in ["true", r#"device.driver == "gpumem.io""#] {
                let selector = Selector::compile(expression).expect("compiles");
                let err = selector.matches(DRA_DRIVER_NAME, &device).expect_err(name);
                assert!(
                    matches!(&err, SelectorError::Runtime(m) if m.starts_with(&format!("attribute {name}: "))),
                    "{name}: {err}"
                );
            }
        }
    }

    #[test]
    fn a_qualified_name_in_the_drivers_domain_is_the_same_attribute() {
        let mut device = t4();
        let attributes = device.attributes.get_or_insert_default();
        attributes.insert(
            "gpumem.io/mig".into(),
            DeviceAttribute {
                bool: Some(false),
                ..Default::default()
            },
        );
        device.allow_multiple_allocations = None;
        let rows = [
            (r#"device.attributes["gpumem.io"].mig == false"#, True),
            (r#"size(device.attributes["gpumem.io"]) == 13"#, True),
            // compile.go: ptr.Deref(AllowMultipleAllocations, false).
            (r#"device.allowMultipleAllocations"#, False),
        ];
        check_table(&rows, &device);
    }

    #[test]
    fn a_capacity_that_is_not_a_quantity_fails_when_read() {
        let mut device = t4();
        let capacity = device.capacity.get_or_insert_default();
        capacity.insert(
            "bad".into(),
            DeviceCapacity {
                value: K8sQuantity("lots".into()),
                request_policy: None,
            },
        );
        let rows = [
            (
                r#"device.capacity["gpumem.io"].bad.isGreaterThan(quantity("1"))"#,
                Runtime,
            ),
            (
                r#"device.capacity["gpumem.io"].memory.isGreaterThan(quantity("1"))"#,
                True,
            ),
        ];
        check_table(&rows, &device);
    }

    /// allocator_incubating.go, selectorsMatch: in order, the first false ends it, errors end it.
    #[test]
    fn selectors_match_stops_as_kube_scheduler_does() {
        const NO: &str = r#"device.driver == "other""#;
        const YES: &str = r#"device.driver == "gpumem.io""#;
        const FAILS: &str = r#"device.attributes["gpumem.io"].missing"#;
        const BROKEN: &str = "1 +";
        let run = |expressions: &[&str]| {
            let selectors: Vec<_> = expressions.iter().map(|e| Selector::compile(e)).collect();
            selectors_match(&selectors, DRA_DRIVER_NAME, &t4())
        };
        assert_eq!(run(&[]), Ok(true));
        assert_eq!(run(&[YES, "true"]), Ok(true));
        assert_eq!(run(&[NO, FAILS]), Ok(false));
        assert_eq!(run(&[NO, BROKEN]), Ok(false));
        assert!(matches!(run(&[YES, FAILS]), Err(SelectorError::Runtime(_))));
        assert!(matches!(run(&[YES, BROKEN]), Err(SelectorError::Compile(_))));
        assert!(matches!(run(&[BROKEN, NO]), Err(SelectorError::Compile(_))));
    }

    /// The parser and the interpreter recurse: no text may panic or overflow the stack, on a
    /// thread with a tokio worker's stack.
    #[test]
    fn nasty_texts_give_errors_not_panics() {
        let deep_parens = format!("{}true{}", "(".repeat(5000), ")".repeat(5000));
        let deep_lists = format!("{}1{} == 1", "[".repeat(300), "]".repeat(300));
        // Within cel-go's 250 levels: parsed (on the compiler's stack), the first is shallow.
        let parens_at_limit = format!("{}true{}", "(".repeat(240), ")".repeat(240));
        let lists_at_limit = format!("{}1{} == []", "[".repeat(240), "]".repeat(240));
        let chain_at_limit = format!("{}0 == 0", "0 + ".repeat(240));
        let long_chain = format!("{}1 > 0", "1 + ".repeat(20_000));
        let long_select = format!("device{} == 1", ".a".repeat(20_000));
        let long_and = vec![r#"device.driver != "x""#; 400].join(" && ");
        let huge = "x".repeat(MAX_CODE_POINTS + 1);
        let cases: Vec<(String, &[Got])> = vec![
            (String::new(), &[Compile]),
            ("   ".into(), &[Compile]),
            ("((((".into(), &[Compile]),
            ("))))".into(), &[Compile]),
            (r#"device.attributes["#.into(), &[Compile]),
            ("\"unterminated".into(), &[Compile]),
            ("'''".into(), &[Compile]),
            ("\u{0}\u{7f}\u{feff}💥".into(), &[Compile]),
            ("has(1)".into(), &[Compile]),
            ("cel.bind(1, 2, 3)".into(), &[Compile]),
            ("device.driver == 'é' && b'\\xff' == b'\\xff'".into(), &[False]),
            // Arithmetic on extreme quantities ends, as in apimachinery.
            (r#"quantity("0e2000000000").isInteger()"#.into(), &[True]),
            (
                r#"quantity("0e2000000000").add(quantity("1")).asApproximateFloat() == 1.0"#.into(),
                &[True],
            ),
            (
                r#"quantity("1e-2000000000").asApproximateFloat() > 0.0"#.into(),
                &[True],
            ),
            (
                r#"semver("99999999999999999999.0.0").major() == 0"#.into(),
                &[Runtime],
            ),
            (deep_parens, &[Unsupported]),
            (deep_lists, &[Unsupported]),
            (parens_at_limit, &[True]),
            (lists_at_limit, &[Unsupported]),
            (chain_at_limit, &[Unsupported]),
            (long_chain, &[Unsupported]),
            (long_select, &[Unsupported]),
            (long_and, &[True]),
            (huge, &[Compile]),
        ];
        let worker = std::thread::Builder::new().stack_size(2 << 20).spawn(move || {
            let device = t4();
            cases
                .into_iter()
                .filter_map(|(text, want)| {
                    let got = outcome(&text, &device);
                    let shown: String = text.chars().take(40).collect();
                    (!want.contains(&got)).then(|| format!("{shown:?}: want {want:?}, got {got:?}"))
                })
                .collect::<Vec<_>>()
        });
        let wrong = worker.expect("spawn").join().expect("no panic");
        assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    }

    /// The deepest tree compiled still evaluates on a 2 MiB stack; one level more is refused.
    #[test]
    fn the_deepest_accepted_expression_runs_on_a_small_stack() {
        // `_==_`, then the `_+_` chain, then the literal.
        let chain = |depth: usize| format!("{} == 0", vec!["0"; depth - 1].join(" + "));
        let selector = Selector::compile(&chain(MAX_TREE_DEPTH)).expect("compiles");
        assert_eq!(tree_depth(&selector.expr), MAX_TREE_DEPTH);
        let too_deep = Selector::compile(&chain(MAX_TREE_DEPTH + 1));
        assert!(
            matches!(too_deep, Err(SelectorError::Unsupported(_))),
            "{too_deep:?}"
        );
        let worker = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || selector.matches(DRA_DRIVER_NAME, &t4()));
        assert_eq!(worker.expect("spawn").join().expect("no overflow"), Ok(true));
    }

    #[test]
    fn a_selector_is_shared_between_threads() {
        let selector = Arc::new(
            Selector::compile(r#"device.attributes["gpumem.io"].memoryMiB >= 15000"#).expect("compiles"),
        );
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let selector = Arc::clone(&selector);
                std::thread::spawn(move || selector.matches(DRA_DRIVER_NAME, &t4()))
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().expect("no panic"), Ok(true));
        }
    }

    /// The representation read from the text agrees with the value `Quantity` parses.
    #[test]
    fn quantities_keep_their_exact_value() {
        for (text, nanos, int) in [
            ("15Gi", 15 * (NANO << 30), Some((15 << 30, 0))),
            ("1.5Gi", 3 * (NANO << 29), None),
            ("2000m", 2 * NANO, Some((2000, -3))),
            ("-0.5", -NANO / 2, Some((-5, -1))),
            ("5e3", 5000 * NANO, Some((5, 3))),
            ("1e-12", 1, None),
            ("0", 0, Some((0, 0))),
            ("123456789012345678901", 123456789012345678901 * NANO, None),
        ] {
            let q = Qty::parse(text).expect(text);
            assert_eq!(q.nanos, nanos, "{text}");
            assert_eq!(go_int64_amount(text), int, "{text}");
            assert_eq!(
                exact_nanos(&Quantity::parse(text).expect(text)),
                Some(nanos),
                "{text}"
            );
        }
        assert!(Qty::parse("1e30").is_err());
    }

    #[test]
    fn the_parse_depth_estimate_follows_nesting_and_resets_at_logical_operators() {
        assert_eq!(parse_depth_estimate("a"), 0);
        assert_eq!(parse_depth_estimate("a.b.c"), 2);
        assert_eq!(parse_depth_estimate("a.b && c.d && e.f"), 1);
        assert_eq!(parse_depth_estimate("f(a.b, c.d.e)"), 3);
        assert_eq!(parse_depth_estimate("x in y"), 1);
        assert_eq!(parse_depth_estimate("index"), 0);
    }
}
