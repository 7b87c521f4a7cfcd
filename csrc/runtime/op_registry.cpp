#include "op_registry.h"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace ascend_vlm {
namespace {

const std::set<std::string> kDtypes = {"float16", "bfloat16", "float32", "float64", "int8",
                                       "uint8",   "int32",    "int64",   "bool"};
const std::set<std::string> kFormats = {"ND", "BNSD", "BSH", "BSND", "SBH", "TND", "NCHW", "NHWC"};
const std::set<std::string> kAttrTypes = {"int", "float", "bool", "str", "int_list", "float_list"};

std::string quoted(const std::string& text) { return "'" + text + "'"; }

std::string joined(const std::set<std::string>& names) {
  std::string out = "{";
  for (const std::string& name : names) out += (out.size() > 1 ? ", " : "") + name;
  return out + "}";
}

[[noreturn]] void reject(const OpDescriptor& op, const std::string& field,
                         const std::string& problem) {
  throw std::invalid_argument("op " + quoted(op.name) + ": " + field + ": " + problem);
}

void check_names(const OpDescriptor& op, const std::string& field,
                 const std::vector<std::string>& values, const std::set<std::string>& known) {
  if (values.empty()) reject(op, field, "expected at least one of " + joined(known) + ", got []");
  for (const std::string& value : values) {
    if (known.count(value) == 0) {
      reject(op, field, "expected names from " + joined(known) + ", got " + quoted(value));
    }
  }
}

void check_tensor(const OpDescriptor& op, const std::string& field, const TensorSpec& tensor) {
  if (tensor.name.empty()) reject(op, field + ".name", "expected a non-empty name, got ''");
  check_names(op, field + ".dtypes", tensor.dtypes, kDtypes);
  check_names(op, field + ".formats", tensor.formats, kFormats);
  if (tensor.rank < -1) {
    reject(op, field + ".rank",
           "expected an int >= 0 or -1 (any rank), got " + std::to_string(tensor.rank));
  }
  // With rank -1 the upper bound is only known per call, so only the sign is checked here.
  for (int64_t axis : tensor.dynamic_dims) {
    if (axis < 0 || (tensor.rank >= 0 && axis >= tensor.rank)) {
      const std::string bound = tensor.rank >= 0 ? std::to_string(tensor.rank) : "rank";
      reject(op, field + ".dynamic_dims",
             "rank mismatch: expected axes in [0, " + bound + "), got " + std::to_string(axis));
    }
  }
  if (tensor.all_dims_dynamic && !tensor.dynamic_dims.empty()) {
    reject(op, field + ".dynamic_dims", "expected either \"all\" or a list of axes, got both");
  }
}

bool default_matches(const std::string& type, const AttrValue& value) {
  if (type == "int") return std::holds_alternative<int64_t>(value);
  if (type == "float") {
    return std::holds_alternative<double>(value) || std::holds_alternative<int64_t>(value);
  }
  if (type == "bool") return std::holds_alternative<bool>(value);
  if (type == "str") return std::holds_alternative<std::string>(value);
  if (type == "int_list") return std::holds_alternative<std::vector<int64_t>>(value);
  // float_list: floats, or ints (an empty or all-integer JSON list)
  return std::holds_alternative<std::vector<double>>(value) ||
         std::holds_alternative<std::vector<int64_t>>(value);
}

const char* value_kind(const AttrValue& value) {
  constexpr const char* kKinds[] = {"bool", "int", "float", "str", "int list", "float list"};
  return kKinds[value.index()];
}

}  // namespace

bool TensorSpec::operator==(const TensorSpec& other) const {
  return name == other.name && dtypes == other.dtypes && formats == other.formats &&
         rank == other.rank && dynamic_dims == other.dynamic_dims &&
         all_dims_dynamic == other.all_dims_dynamic && optional == other.optional;
}

bool AttrSpec::operator==(const AttrSpec& other) const {
  return name == other.name && type == other.type && default_value == other.default_value;
}

bool OpDescriptor::operator==(const OpDescriptor& other) const {
  return name == other.name && summary == other.summary && npu_kernel == other.npu_kernel &&
         inputs == other.inputs && outputs == other.outputs && attrs == other.attrs;
}

void validate_op_descriptor(const OpDescriptor& op) {
  if (op.name.empty()) reject(op, "name", "expected a non-empty op name, got ''");
  std::set<std::string> seen;
  auto claim = [&](const std::string& field, const std::string& name) {
    if (!seen.insert(name).second) {
      reject(op, field,
             "duplicate name " + quoted(name) + " (tensor and attr names must be unique)");
    }
  };
  for (const auto* group : {&op.inputs, &op.outputs}) {
    const std::string kind = group == &op.inputs ? "inputs" : "outputs";
    for (size_t i = 0; i < group->size(); ++i) {
      const std::string field = kind + "[" + std::to_string(i) + "]";
      check_tensor(op, field, (*group)[i]);
      claim(field + ".name", (*group)[i].name);
    }
  }
  for (size_t i = 0; i < op.attrs.size(); ++i) {
    const AttrSpec& attr = op.attrs[i];
    const std::string field = "attrs[" + std::to_string(i) + "]";
    if (attr.name.empty()) reject(op, field + ".name", "expected a non-empty name, got ''");
    claim(field + ".name", attr.name);
    if (kAttrTypes.count(attr.type) == 0) {
      reject(op, field + ".type",
             "expected one of " + joined(kAttrTypes) + ", got " + quoted(attr.type));
    }
    if (attr.default_value && !default_matches(attr.type, *attr.default_value)) {
      reject(op, field + ".default",
             "expected a value of type " + quoted(attr.type) + ", got " +
                 value_kind(*attr.default_value));
    }
  }
}

OpRegistry& OpRegistry::global() {
  static OpRegistry* registry = new OpRegistry();
  return *registry;
}

void OpRegistry::add(const OpDescriptor& op) {
  validate_op_descriptor(op);
  std::lock_guard lock(mutex_);
  auto [it, inserted] = ops_.emplace(op.name, op);
  if (!inserted && !(it->second == op)) {
    reject(op, "name", "already registered with a different descriptor; unregister it first");
  }
}

bool OpRegistry::remove(const std::string& name) {
  std::lock_guard lock(mutex_);
  return ops_.erase(name) == 1;
}

std::optional<OpDescriptor> OpRegistry::find(const std::string& name) const {
  std::lock_guard lock(mutex_);
  auto it = ops_.find(name);
  if (it == ops_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> OpRegistry::names() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> out;
  for (const auto& [name, op] : ops_) out.push_back(name);
  return out;
}

}  // namespace ascend_vlm
