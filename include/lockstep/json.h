// JSON string literals for the files Lockstep writes by hand (JSONL summaries,
// Chrome traces).
#ifndef LOCKSTEP_JSON_H_
#define LOCKSTEP_JSON_H_

#include <string>
#include <string_view>

namespace lockstep {

// `text` as a quoted JSON string: '"' and '\' escaped, control characters as
// \u00XX, every other byte as it is (UTF-8 passes through).
std::string JsonQuote(std::string_view text);

}  // namespace lockstep

#endif  // LOCKSTEP_JSON_H_
