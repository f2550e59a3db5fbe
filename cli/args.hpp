// Command-line parsing for the statedict tool: a small, strict parser (unknown options and missing
// values are usage errors with exit code 2).
#pragma once

#include <statedict/statedict.hpp>

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cli {

namespace errors {
// clang-format off
inline constexpr statedict::error_id usage         {800, statedict::error_kind::usage, "cli.usage"};
inline constexpr statedict::error_id bad_option    {801, statedict::error_kind::usage, "cli.bad_option"};
inline constexpr statedict::error_id bad_value     {802, statedict::error_kind::usage, "cli.bad_value"};
// clang-format on
}  // namespace errors

struct OptionSpec {
  std::string name;       ///< "--dtype"
  bool takes_value;       ///< "--dtype BF16" / "--dtype=BF16"
  bool repeatable = false;
};

class Args {
 public:
  Args(const std::vector<std::string>& argv, const std::vector<OptionSpec>& spec, std::size_t min_pos, std::size_t max_pos,
       std::string_view command)
      : command_(command) {
    bool only_positional = false;
    for (std::size_t i = 0; i < argv.size(); ++i) {
      const std::string& a = argv[i];
      if (only_positional || a.size() < 2 || a[0] != '-' || a == "-") {
        positional_.push_back(a);
        continue;
      }
      if (a == "--") {
        only_positional = true;
        continue;
      }
      std::string name = a;
      std::optional<std::string> value;
      if (const auto eq = a.find('='); eq != std::string::npos && a.rfind("--", 0) == 0) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
      }
      const OptionSpec* s = nullptr;
      for (const auto& o : spec)
        if (o.name == name) s = &o;
      if (!s) fail(errors::bad_option, "unknown option " + statedict::quote(name));
      if (s->takes_value) {
        if (!value) {
          if (i + 1 >= argv.size()) fail(errors::bad_value, "option " + name + " needs a value");
          value = argv[++i];
        }
      } else if (value) {
        fail(errors::bad_value, "option " + name + " takes no value");
      }
      auto& slot = options_[name];
      if (!slot.empty() && !s->repeatable) fail(errors::bad_option, "option " + name + " given more than once");
      slot.push_back(value.value_or(""));
      sequence_.emplace_back(name, value.value_or(""));
    }
    if (positional_.size() < min_pos || positional_.size() > max_pos)
      fail(errors::usage, "expected " +
                              (min_pos == max_pos ? std::to_string(min_pos)
                                                  : std::to_string(min_pos) + " to " + std::to_string(max_pos)) +
                              " arguments, got " + std::to_string(positional_.size()));
  }

  [[nodiscard]] const std::vector<std::string>& positional() const { return positional_; }
  [[nodiscard]] bool flag(const std::string& name) const { return options_.count(name) != 0; }
  [[nodiscard]] std::optional<std::string> value(const std::string& name) const {
    auto it = options_.find(name);
    if (it == options_.end()) return std::nullopt;
    return it->second.back();
  }
  [[nodiscard]] std::vector<std::string> values(const std::string& name) const {
    auto it = options_.find(name);
    return it == options_.end() ? std::vector<std::string>{} : it->second;
  }

  /// Every option given, with its value, in command-line order.
  [[nodiscard]] const std::vector<std::pair<std::string, std::string>>& sequence() const { return sequence_; }

  [[noreturn]] void fail(const statedict::error_id& id, const std::string& detail) const {
    statedict::throw_error(id, "statedict " + command_, detail + " (see 'statedict " + command_ + " --help')");
  }

 private:
  std::string command_;
  std::vector<std::string> positional_;
  std::map<std::string, std::vector<std::string>> options_;
  std::vector<std::pair<std::string, std::string>> sequence_;
};

}  // namespace cli
